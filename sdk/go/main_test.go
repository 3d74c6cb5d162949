package envelope

// The tests that need Redis use $ENVELOPE_TEST_REDIS_URL when it is set (the
// Python suite sets it to its private server). Otherwise TestMain starts a
// private redis-server on a free loopback port (never 6379) for the run, and
// stops it at the end; without redis-server on PATH those tests are skipped.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
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
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", nil, err
	}
	dir, err := os.MkdirTemp("", "envelope-go-redis-")
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(bin, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", dir)
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	cleanup := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		os.RemoveAll(dir)
	}
	url := fmt.Sprintf("redis://127.0.0.1:%d/0", port)
	client, err := NewClient(url)
	if err != nil {
		cleanup()
		return "", nil, err
	}
	defer client.Close()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if client.Ping(context.Background()).Err() == nil {
			return url, cleanup, nil
		}
		if time.Now().After(deadline) {
			cleanup()
			return "", nil, fmt.Errorf("redis-server on port %d did not answer", port)
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
