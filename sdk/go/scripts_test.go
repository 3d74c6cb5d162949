package envelope

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// The embedded scripts are the ones of kombu_envelope/lua/ (sdk/sync_lua.py copies them;
// tests/test_sdk_lua_copies.py checks every SDK, this checks what this build embeds).
func TestEmbeddedScriptsAreTheSources(t *testing.T) {
	scripts := DefaultScripts()
	for _, name := range ScriptNames {
		if scripts[name] == nil {
			t.Errorf("script %s is not embedded", name)
		}
	}
	sources := filepath.Join(repoRoot(t), "kombu_envelope", "lua")
	files, err := filepath.Glob(filepath.Join(sources, "*.lua"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no scripts in %s: %v", sources, err)
	}
	for _, f := range files {
		want, _ := os.ReadFile(f)
		got, err := embedded.ReadFile("lua/" + filepath.Base(f))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("lua/%s differs from %s (run python sdk/sync_lua.py): %v", filepath.Base(f), f, err)
		}
	}
	if entries, _ := embedded.ReadDir("lua"); len(entries) != len(files) {
		t.Errorf("%d scripts embedded, %d in %s", len(entries), len(files), sources)
	}
}

func TestLoadScriptsWithoutADirectoryUsesTheEmbeddedOnes(t *testing.T) {
	t.Setenv(ScriptDirEnv, "")
	scripts, err := LoadScripts("")
	if err != nil {
		t.Fatal(err)
	}
	if scripts.Get("enqueue").Hash() != DefaultScripts().Get("enqueue").Hash() {
		t.Fatal("LoadScripts(\"\") did not return the embedded scripts")
	}
	if _, err := LoadScripts(t.TempDir()); err == nil {
		t.Fatal("LoadScripts of an empty directory succeeded")
	}
}
