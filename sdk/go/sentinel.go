package envelope

// Finding a Sentinel group's primary: the address more than half of the
// listed sentinels name (docs/protocol.md section 5, "Failover").
//
// go-redis' failover client trusts the first sentinel that answers. Just
// after a failover a sentinel that has not heard of it yet still names the
// old primary, and a node that was killed and started again answers as an
// empty primary until the sentinels turn it into a replica: writes sent
// there are lost when that happens. majorityPrimary is a dial hook of that
// client: every new connection, reconnections included, goes to the primary
// a majority names now, or fails with a *SentinelMajorityError, an outage
// (IsOutage) the SDK waits out.

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMajorityError is a connection attempt that found no primary named
// by more than half of the listed sentinels; Named says, in the order of the
// URL, what each sentinel answered.
type SentinelMajorityError struct {
	MasterName     string
	Needed, Listed int
	Named          []SentinelAnswer
}

// SentinelAnswer is what one sentinel said about the primary: its address
// (Primary, "" when it named none it vouches for) or why it gave none.
type SentinelAnswer struct {
	Sentinel, Primary string
	Err               error  // the sentinel could not be asked
	Reason            string // why Primary does not count, when it does not
}

// String is the answer as the error message quotes it.
func (a SentinelAnswer) String() string {
	switch {
	case a.Err != nil:
		return a.Sentinel + ": " + a.Err.Error()
	case a.Reason != "":
		return a.Sentinel + ": " + a.Reason
	}
	return a.Sentinel + " names " + a.Primary
}

// Error names the rule (how many of the listed sentinels must agree) and each answer.
func (e *SentinelMajorityError) Error() string {
	said := make([]string, len(e.Named))
	for i, a := range e.Named {
		said[i] = a.String()
	}
	return fmt.Sprintf("sentinel majority for master_name %q: %d of the %d listed sentinels must name the "+
		"same primary; %s", e.MasterName, e.Needed, e.Listed, strings.Join(said, "; "))
}

// Unwrap is the errors of the sentinels that could not be asked, so that
// IsOutage sees a refused certificate or password among them.
func (e *SentinelMajorityError) Unwrap() []error {
	var errs []error
	for _, a := range e.Named {
		if a.Err != nil {
			errs = append(errs, a.Err)
		}
	}
	return errs
}

// majorityPrimary is a redis.Hook for a failover client: it dials the primary
// the majority of sentinels (one set of options each) name for masterName.
type majorityPrimary struct {
	masterName string
	sentinels  []*redis.Options
	tlsConfig  *tls.Config // nil without TLS
}

// sentinelTimeout bounds asking one sentinel (dial, then its answer): a stalled
// sentinel must not hold up finding the primary.
const sentinelTimeout = 5 * time.Second

func newMajorityPrimary(u *multiHostURL) *majorityPrimary {
	m := &majorityPrimary{masterName: u.masterName, tlsConfig: u.tlsConfig}
	seen := map[string]bool{}
	for _, addr := range u.addrs {
		if seen[addr] { // a sentinel listed twice votes once
			continue
		}
		seen[addr] = true
		m.sentinels = append(m.sentinels, &redis.Options{Addr: addr, Username: u.sentinelUsername,
			Password: u.sentinelPassword, TLSConfig: u.tlsConfig, Protocol: 2, DisableIdentity: true,
			MaxRetries: -1, DialerRetries: 1, PoolSize: 1, DialTimeout: sentinelTimeout,
			ReadTimeout: sentinelTimeout, WriteTimeout: sentinelTimeout})
	}
	return m
}

// DialHook asks the sentinels on every dial. It still lets go-redis dial the
// primary its own sentinel names, which keeps that sentinel's +switch-master
// subscription (old connections are dropped on a failover), and keeps the
// connection when it reached the majority's primary; else it closes it and
// dials that primary itself.
func (m *majorityPrimary) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		primary, err := m.discover(ctx)
		if err != nil {
			return nil, err
		}
		if conn, err := next(ctx, network, addr); err == nil {
			if conn.RemoteAddr().String() == primary {
				return conn, nil
			}
			conn.Close()
		}
		dialer := &net.Dialer{}
		if m.tlsConfig == nil {
			return dialer.DialContext(ctx, network, primary)
		}
		return (&tls.Dialer{NetDialer: dialer, Config: m.tlsConfig}).DialContext(ctx, network, primary)
	}
}

// ProcessHook and ProcessPipelineHook leave commands alone.
func (m *majorityPrimary) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (m *majorityPrimary) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// discover asks every listed sentinel at once which primary it monitors as
// masterName (SENTINEL MASTER, counted only when the sentinel holds it a
// master that is not down) and returns the address named by more than half
// of them, as soon as one is.
func (m *majorityPrimary) discover(ctx context.Context) (string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	answers := make(chan int, len(m.sentinels))
	named := make([]SentinelAnswer, len(m.sentinels))
	for i, opts := range m.sentinels {
		go func() {
			named[i] = m.ask(ctx, opts)
			answers <- i
		}()
	}
	needed := len(m.sentinels)/2 + 1
	votes := map[string]int{}
	for range m.sentinels {
		a := named[<-answers]
		if a.Primary == "" || a.Reason != "" {
			continue
		}
		if votes[a.Primary]++; votes[a.Primary] >= needed {
			return a.Primary, nil
		}
	}
	return "", &SentinelMajorityError{MasterName: m.masterName, Needed: needed, Listed: len(m.sentinels),
		Named: named}
}

// ask is one sentinel's answer about masterName.
func (m *majorityPrimary) ask(ctx context.Context, opts *redis.Options) SentinelAnswer {
	sentinel := redis.NewSentinelClient(opts)
	defer sentinel.Close()
	a := SentinelAnswer{Sentinel: opts.Addr}
	state, err := sentinel.Master(ctx, m.masterName).Result()
	if err != nil {
		a.Err = err
		return a
	}
	a.Primary = net.JoinHostPort(state["ip"], state["port"])
	flags := strings.Split(state["flags"], ",")
	if !slices.Contains(flags, "master") || slices.Contains(flags, "s_down") || slices.Contains(flags, "o_down") {
		a.Reason = fmt.Sprintf("names %s in state %q, not counted", a.Primary, state["flags"])
	}
	return a
}
