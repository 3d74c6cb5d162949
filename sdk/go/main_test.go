package envelope

// The tests that need Redis use $ENVELOPE_TEST_REDIS_URL when it is set (the
// Python suite sets it to its private server). Otherwise TestMain starts a
// private redis-server on a free loopback port (never 6379) for the run, and
// stops it at the end; without redis-server on PATH those tests are skipped.

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// testRedisURL is the Redis the tests use, "" when there is none.
var testRedisURL string

func TestMain(m *testing.M) {
	testRedisURL = os.Getenv("ENVELOPE_TEST_REDIS_URL")
	stop := func() {}
	if testRedisURL == "" {
		url, cleanup, err := startRedis()
		if err != nil {
			fmt.Fprintf(os.Stderr, "no private redis-server (%v): the Redis tests are skipped\n", err)
		} else {
			testRedisURL, stop = url, cleanup
		}
	}
	code := m.Run()
	stop()
	os.Exit(code)
}

// startRedis runs redis-server on a free loopback port, without persistence.
func startRedis() (string, func(), error) {
	port, err := freePort()
	if err != nil {
		return "", nil, err
	}
	return startRedisAt(port)
}

// freePort is a loopback port nothing listens on (never 6379).
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startRedisAt runs redis-server on port, without persistence.
func startRedisAt(port int) (string, func(), error) {
	srv, err := startServer(port, nil, "")
	if err != nil {
		return "", nil, err
	}
	return fmt.Sprintf("redis://%s/0", srv.addr()), srv.stop, nil
}

// redisServer is a redis-server process of a test (a node, a replica, a sentinel).
type redisServer struct {
	port     int
	dir      string
	cmd      *exec.Cmd
	tls      *tls.Config // how the tests' own clients reach a TLS-only server; nil for plain TCP
	password string      // requirepass, set by the test that configured one
	once     sync.Once
	dead     atomic.Bool // killed
}

func (s *redisServer) addr() string { return fmt.Sprintf("127.0.0.1:%d", s.port) }

// options are those of the tests' own clients of the server, without retries.
func (s *redisServer) options() *redis.Options {
	return &redis.Options{Addr: s.addr(), Password: s.password, TLSConfig: s.tls, Protocol: 2,
		DisableIdentity: true, MaxRetries: -1, DialTimeout: 300 * time.Millisecond}
}

// kill ends the process with SIGKILL (a crash: nothing is flushed); it is safe to repeat.
func (s *redisServer) kill() {
	s.once.Do(func() {
		s.dead.Store(true)
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
	})
}

// stop kills the process and removes its directory.
func (s *redisServer) stop() {
	s.kill()
	os.RemoveAll(s.dir)
}

// startServer runs redis-server on a loopback port, without persistence, in
// a directory of its own, with extra arguments; it returns once the server
// answers PING. A non-empty conf is written to a config file the server
// starts from (sentinels need one and rewrite it). With certs the server
// speaks TLS only, on port (see certificates.serverArgs).
func startServer(port int, certs *certificates, conf string, extra ...string) (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "envelope-go-redis-")
	if err != nil {
		return nil, err
	}
	return launchServer(bin, port, dir, certs, conf, extra...)
}

// launchServer runs redis-server on port in dir (removed if it fails to
// start), as startServer describes; a restart passes the same port and dir.
func launchServer(bin string, port int, dir string, certs *certificates, conf string,
	extra ...string) (*redisServer, error) {
	args := []string{"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", dir}
	if certs != nil {
		args = append(args, certs.serverArgs(port)...)
	}
	if conf != "" {
		file := filepath.Join(dir, "redis.conf")
		if err := os.WriteFile(file, []byte(conf), 0o600); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		args = append([]string{file}, args...)
	}
	cmd := exec.Command(bin, append(args, extra...)...)
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	srv := &redisServer{port: port, dir: dir, cmd: cmd}
	if certs != nil {
		srv.tls = certs.clientConfig()
	}
	client := redis.NewClient(srv.options())
	defer client.Close()
	for deadline := time.Now().Add(10 * time.Second); ; {
		// NOAUTH: a server with requirepass answers too
		if err := client.Ping(context.Background()).Err(); err == nil || strings.HasPrefix(err.Error(), "NOAUTH") {
			return srv, nil
		}
		if time.Now().After(deadline) {
			srv.stop()
			return nil, fmt.Errorf("redis-server on port %d did not answer", port)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// repoRoot is the kombu-envelope checkout this module sits in: the first
// parent directory holding conformance/manifest.json.
func repoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "conformance", "manifest.json")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no conformance/manifest.json above the working directory; set ENVELOPE_CONFORMANCE_DIR")
		}
		dir = parent
	}
}
