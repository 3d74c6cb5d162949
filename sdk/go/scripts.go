package envelope

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"os"
	"path"

	"github.com/redis/go-redis/v9"
)

// ScriptDirEnv names the environment variable that points at the Lua scripts.
const ScriptDirEnv = "ENVELOPE_LUA_DIR"

// embedded are the scripts this module ships: sdk/go/lua/ is a copy of
// kombu_envelope/lua/ made by sdk/sync_lua.py, never edited by hand.
//
//go:embed lua/*.lua
var embedded embed.FS

// ScriptNames are the Lua files every language loads as they are.
var ScriptNames = []string{
	"enqueue", "schedule", "promote", "read", "requeue", "dead_letter", "retry", "cancel",
	"idem_begin", "idem_finish", "retry_slot", "forget_consumer", "replay",
}

// Scripts are the protocol's Lua scripts, shipped with the module, never re-implemented.
type Scripts map[string]*redis.Script

// ResolveScriptDir returns dir, else $ENVELOPE_LUA_DIR, else "" (the embedded scripts).
func ResolveScriptDir(dir string) string {
	if dir != "" {
		return dir
	}
	return os.Getenv(ScriptDirEnv)
}

// DefaultScripts are the scripts embedded in this module.
func DefaultScripts() Scripts {
	s, err := loadFrom(embedded, "lua")
	if err != nil {
		panic(err) // the build embeds every script; sdk/sync_lua.py --check guards the copies
	}
	return s
}

// LoadScripts reads every script from dir, else from $ENVELOPE_LUA_DIR; with
// neither it returns the embedded scripts (DefaultScripts). A directory is only
// needed to run scripts other than the ones this module version ships.
func LoadScripts(dir string) (Scripts, error) {
	dir = ResolveScriptDir(dir)
	if dir == "" {
		return DefaultScripts(), nil
	}
	return loadFrom(os.DirFS(dir), ".")
}

func loadFrom(fsys fs.FS, dir string) (Scripts, error) {
	s := Scripts{}
	for _, name := range ScriptNames {
		src, err := fs.ReadFile(fsys, path.Join(dir, name+".lua"))
		if err != nil {
			return nil, fmt.Errorf("loading Lua script %s (from %s; $%s overrides): %w", name, dir, ScriptDirEnv, err)
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
