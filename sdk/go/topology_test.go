package envelope

// Sentinel and Cluster topologies for the high-availability tests, started
// from the redis-server binary on free loopback ports (never 6379).

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// startNode runs one redis-server for a topology and stops it when the test ends.
func startNode(t *testing.T, conf string, extra ...string) *redisServer {
	return startTLSNode(t, nil, conf, extra...)
}

// startTLSNode is startNode for a server that speaks TLS only, with certs
// (plain TCP when certs is nil).
func startTLSNode(t *testing.T, certs *certificates, conf string, extra ...string) *redisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server is not on PATH")
	}
	pick := freePort
	if slices.Contains(extra, "--cluster-enabled") {
		pick = freeClusterPort
	}
	port, err := pick()
	if err != nil {
		t.Fatal(err)
	}
	srv, err := startServer(port, certs, conf, extra...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.stop)
	return srv
}

// clusterBusOffset is how far above its port a Cluster node binds its bus.
const clusterBusOffset = 10000

// freeClusterPort is a free loopback port whose cluster-bus port is free as
// well and at most 65535 (redis-server refuses to start otherwise, and
// freePort answers ports up to 60999 on Linux).
func freeClusterPort() (int, error) {
	for {
		port, err := freePort()
		if err != nil {
			return 0, err
		}
		if port+clusterBusOffset > 65535 {
			continue
		}
		bus, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+clusterBusOffset))
		if err != nil {
			continue
		}
		bus.Close()
		return port, nil
	}
}

// nodeClient is a plain client of one node, closed when the test ends.
func nodeClient(t *testing.T, srv *redisServer) *redis.Client {
	c := directClient(srv)
	t.Cleanup(func() { c.Close() })
	return c
}

// directClient is a plain client of one node without retries; the caller closes it.
func directClient(srv *redisServer) *redis.Client {
	return redis.NewClient(srv.options())
}

// eventually polls cond every 50 ms until it holds, failing the test after limit.
func eventually(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", limit, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// infoField is one field of an INFO section of a node ("" when it does not answer).
func infoField(c *redis.Client, section, field string) string {
	info, err := c.Info(context.Background(), section).Result()
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return v
		}
	}
	return ""
}

// sentinelGroup is a primary, its replicas and three sentinels that monitor
// them as masterName (quorum 2, down after 1 s, failover timeout 3 s).
type sentinelGroup struct {
	data      []*redisServer // data[0] starts as the primary
	sentinels []*redisServer
	setup     groupSetup
}

// groupSetup is what a sentinel group is made of besides its three sentinels.
type groupSetup struct {
	replicas         int
	certs            *certificates // TLS only, replication and the sentinels' links included
	sentinelPassword string        // requirepass of the sentinels
}

const masterName = "envelope-main"

// startSentinelGroup is a primary, two replicas and three sentinels, on plain TCP.
func startSentinelGroup(t *testing.T) *sentinelGroup {
	return startSentinelGroupWith(t, groupSetup{replicas: 2})
}

func startSentinelGroupWith(t *testing.T, setup groupSetup) *sentinelGroup {
	g := &sentinelGroup{setup: setup}
	var tlsArgs []string
	if setup.certs != nil {
		tlsArgs = []string{"--tls-replication", "yes"}
	}
	primary := startTLSNode(t, setup.certs, "", tlsArgs...)
	g.data = append(g.data, primary)
	for range setup.replicas {
		g.data = append(g.data, startTLSNode(t, setup.certs, "",
			append([]string{"--replicaof", "127.0.0.1", fmt.Sprint(primary.port)}, tlsArgs...)...))
	}
	conf := fmt.Sprintf("sentinel monitor %[1]s 127.0.0.1 %[2]d 2\n"+
		"sentinel down-after-milliseconds %[1]s 2000\nsentinel failover-timeout %[1]s 3000\n"+
		"sentinel parallel-syncs %[1]s 2\n", masterName, primary.port)
	if setup.sentinelPassword != "" {
		conf += "requirepass " + setup.sentinelPassword + "\n"
	}
	for range 3 {
		s := startTLSNode(t, setup.certs, conf, append([]string{"--sentinel"}, tlsArgs...)...)
		s.password = setup.sentinelPassword
		g.sentinels = append(g.sentinels, s)
	}
	for _, s := range g.sentinels {
		c := nodeClient(t, s)
		eventually(t, 15*time.Second, "sentinels that know every replica and each other", func() bool {
			m, err := c.Do(context.Background(), "SENTINEL", "MASTER", masterName).StringSlice()
			fields := map[string]string{}
			for i := 0; err == nil && i+1 < len(m); i += 2 {
				fields[m[i]] = m[i+1]
			}
			return fields["num-slaves"] == fmt.Sprint(setup.replicas) && fields["num-other-sentinels"] == "2"
		})
	}
	for _, r := range g.data[1:] {
		c := nodeClient(t, r)
		eventually(t, 10*time.Second, "replicas in sync", func() bool {
			return infoField(c, "replication", "master_link_status") == "up"
		})
	}
	return g
}

// url is the redis-sentinel:// URL of the group (rediss-sentinel:// with
// TLS, query parameters to add after the master name).
func (g *sentinelGroup) url() string {
	addrs := make([]string, len(g.sentinels))
	for i, s := range g.sentinels {
		addrs[i] = s.addr()
	}
	scheme := "redis-sentinel://"
	if g.setup.certs != nil {
		scheme = "rediss-sentinel://"
	}
	return scheme + strings.Join(addrs, ",") + "/0#" + masterName
}

// agreedPrimary is the data node every sentinel names as primary, nil while
// they disagree or name a node that is not a primary (yet).
func (g *sentinelGroup) agreedPrimary() *redisServer {
	var named *redisServer
	for _, s := range g.sentinels {
		c := directClient(s)
		addr, err := c.Do(context.Background(), "SENTINEL", "GET-MASTER-ADDR-BY-NAME", masterName).StringSlice()
		c.Close()
		if err != nil || len(addr) != 2 {
			return nil
		}
		var found *redisServer
		for _, d := range g.data {
			if fmt.Sprint(d.port) == addr[1] {
				found = d
			}
		}
		if found == nil || (named != nil && found != named) {
			return nil
		}
		named = found
	}
	if named.dead.Load() {
		return nil
	}
	c := directClient(named)
	defer c.Close()
	if infoField(c, "replication", "role") != "master" {
		return nil
	}
	return named
}

// settled waits until the sentinels agree on a primary that has every other
// running data node as a replica in sync.
func (g *sentinelGroup) settled(t *testing.T) {
	eventually(t, 20*time.Second, "the sentinel group to settle", func() bool {
		p := g.agreedPrimary()
		if p == nil {
			return false
		}
		replicas := 0
		for _, d := range g.data {
			if d != p && !d.dead.Load() {
				replicas++
			}
		}
		c := directClient(p)
		defer c.Close()
		return infoField(c, "replication", "connected_slaves") == fmt.Sprint(replicas)
	})
}

// killPrimary SIGKILLs the primary the sentinels agree on, and returns a
// check that reports when they agree on another one, and a check, for after
// the drill, that they still agree on that one: a second failover (of a live
// primary) is not what a drill of one failover measures.
func (g *sentinelGroup) killPrimary(t *testing.T) (kill func(), failedOver func() bool, sameSince func()) {
	var killed, promoted *redisServer
	kill = func() {
		if killed = g.agreedPrimary(); killed == nil {
			t.Fatal("the sentinels agree on no primary")
		}
		killed.kill()
	}
	failedOver = func() bool {
		p := g.agreedPrimary()
		if p != nil && p != killed {
			promoted = p
			return true
		}
		return false
	}
	sameSince = func() {
		if p := g.agreedPrimary(); p != promoted {
			now := "no primary"
			if p != nil {
				now = p.addr()
			}
			t.Errorf("the sentinels failed over again after promoting %s: they now agree on %s",
				promoted.addr(), now)
		}
	}
	return kill, failedOver, sameSince
}

// redisCluster is three primaries with replicas (node timeout 1 s).
type redisCluster struct {
	nodes []*redisServer
	certs *certificates // TLS only, the cluster bus and replication included
}

// startCluster is three primaries with one replica each, on plain TCP.
func startCluster(t *testing.T) *redisCluster {
	return startClusterWith(t, 1, nil)
}

// startClusterWith is three primaries with replicas replicas each, speaking
// TLS only with certs.
func startClusterWith(t *testing.T, replicas int, certs *certificates) *redisCluster {
	if _, err := exec.LookPath("redis-cli"); err != nil {
		t.Skip("redis-cli is not on PATH")
	}
	c := &redisCluster{certs: certs}
	nodeArgs := []string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0"}
	var args []string
	if certs != nil {
		nodeArgs = append(nodeArgs, "--tls-cluster", "yes", "--tls-replication", "yes")
		args = []string{"--tls", "--cacert", certs.ca}
	}
	args = append(args, "--cluster", "create")
	for range 3 * (1 + replicas) {
		n := startTLSNode(t, certs, "", nodeArgs...)
		c.nodes = append(c.nodes, n)
		args = append(args, n.addr())
	}
	args = append(args, "--cluster-replicas", fmt.Sprint(replicas), "--cluster-yes")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, n := range c.nodes {
		nc := nodeClient(t, n)
		eventually(t, 20*time.Second, "cluster_state:ok on "+n.addr(), func() bool {
			return infoClusterState(nc) == "ok" && (infoField(nc, "replication", "role") == "master" ||
				infoField(nc, "replication", "master_link_status") == "up")
		})
	}
	return c
}

func infoClusterState(c *redis.Client) string {
	info, err := c.ClusterInfo(context.Background()).Result()
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "cluster_state:"); ok {
			return v
		}
	}
	return ""
}

// url is the redis-cluster:// URL of the cluster, naming two seed nodes
// (rediss-cluster:// with TLS, query parameters to add).
func (c *redisCluster) url() string {
	scheme := "redis-cluster://"
	if c.certs != nil {
		scheme = "rediss-cluster://"
	}
	return scheme + c.nodes[0].addr() + "," + c.nodes[1].addr()
}

// primaryOf is the node that serves key's slot as primary, by CLUSTER KEYSLOT
// and CLUSTER NODES asked of the first node that answers; nil when that node
// knows no primary of the slot that is not failing.
func (c *redisCluster) primaryOf(key string) *redisServer {
	for _, n := range c.nodes {
		nc := directClient(n)
		defer nc.Close()
		slot, err := nc.ClusterKeySlot(context.Background(), key).Result()
		if err != nil {
			continue
		}
		nodes, err := nc.ClusterNodes(context.Background()).Result()
		if err != nil {
			continue
		}
		for _, line := range strings.Split(strings.TrimSpace(nodes), "\n") {
			f := strings.Fields(line)
			if len(f) < 9 || !strings.Contains(f[2], "master") || strings.Contains(f[2], "fail") {
				continue
			}
			for _, r := range f[8:] {
				lo, hi, _ := strings.Cut(r, "-")
				if hi == "" {
					hi = lo
				}
				var a, b int64
				if _, err := fmt.Sscan(lo, &a); err != nil {
					continue
				}
				if _, err := fmt.Sscan(hi, &b); err != nil {
					continue
				}
				if slot >= a && slot <= b {
					addr, _, _ := strings.Cut(f[1], "@")
					for _, s := range c.nodes {
						if s.addr() == addr {
							return s
						}
					}
				}
			}
		}
		return nil
	}
	return nil
}

// healthy reports whether every node still running says cluster_state:ok.
func (c *redisCluster) healthy() bool {
	for _, n := range c.nodes {
		if n.dead.Load() {
			continue
		}
		nc := directClient(n)
		state := infoClusterState(nc)
		nc.Close()
		if state != "ok" {
			return false
		}
	}
	return true
}
