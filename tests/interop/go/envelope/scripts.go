package envelope

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/redis/go-redis/v9"
)

// ScriptDirEnv names the environment variable that points at the Lua scripts.
const ScriptDirEnv = "ENVELOPE_LUA_DIR"

// DefaultScriptDir is where the scripts are relative to tests/interop/go.
const DefaultScriptDir = "../../../kombu_envelope/lua"

// ScriptNames are the Lua files every language loads as they are.
var ScriptNames = []string{
	"enqueue", "schedule", "promote", "read", "requeue", "dead_letter", "retry", "cancel",
	"idem_begin", "idem_finish", "retry_slot", "forget_consumer",
}

// Scripts are the protocol's Lua scripts, read from disk, never re-implemented.
type Scripts map[string]*redis.Script

// ResolveScriptDir returns dir, else $ENVELOPE_LUA_DIR, else DefaultScriptDir.
func ResolveScriptDir(dir string) string {
	if dir != "" {
		return dir
	}
	if env := os.Getenv(ScriptDirEnv); env != "" {
		return env
	}
	return DefaultScriptDir
}

// LoadScripts reads every script from dir (see ResolveScriptDir).
func LoadScripts(dir string) (Scripts, error) {
	dir = ResolveScriptDir(dir)
	s := Scripts{}
	for _, name := range ScriptNames {
		src, err := os.ReadFile(filepath.Join(dir, name+".lua"))
		if err != nil {
			return nil, fmt.Errorf("loading Lua script %s (set --lua-dir or $%s): %w", name, ScriptDirEnv, err)
		}
		s[name] = redis.NewScript(string(src))
	}
	return s, nil
}

// Load runs SCRIPT LOAD for every script, so EVALSHA works inside MULTI.
func (s Scripts) Load(ctx context.Context, c redis.Scripter) error {
	for name, script := range s {
		if err := script.Load(ctx, c).Err(); err != nil {
			return fmt.Errorf("SCRIPT LOAD %s: %w", name, err)
		}
	}
	return nil
}

// Get returns a script by name; it panics on a name that is not in ScriptNames.
func (s Scripts) Get(name string) *redis.Script {
	script, ok := s[name]
	if !ok {
		panic("unknown script " + name)
	}
	return script
}
