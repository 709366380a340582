package controlplane

import (
	"net/http"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestLoadHeaders: placeholders are replaced once; an empty {env.…} is one
// WARN naming the option that sends it, the header and the placeholder,
// and a set one none.
func TestLoadHeaders(t *testing.T) {
	t.Setenv("CP_TEST_SET", "s3cret")
	t.Setenv("CP_TEST_EMPTY", "")
	for _, option := range []string{"activity_push", "wake", "sandbox_lookup"} {
		core, logs := observer.New(zapcore.DebugLevel)
		got := LoadHeaders(zap.New(core), option, http.Header{
			"Authorization": {"Bearer {env.CP_TEST_SET}"},
			"X-Tenant":      {"t-{env.CP_TEST_EMPTY}"},
		})
		if got.Get("Authorization") != "Bearer s3cret" || got.Get("X-Tenant") != "t-" {
			t.Errorf("%s: headers %v, want the placeholders replaced", option, got)
		}
		entries := logs.All()
		if len(entries) != 1 {
			t.Fatalf("%s: %d log lines, want 1: %v", option, len(entries), entries)
		}
		f := entries[0].ContextMap()
		if e := entries[0]; e.Level != zapcore.WarnLevel || e.Message != option+" header placeholder is empty: the header goes out without it" ||
			f["option"] != option || f["header"] != "X-Tenant" || f["placeholder"] != "{env.CP_TEST_EMPTY}" {
			t.Errorf("%s: line %q %v, want a WARN naming the option, the header and the placeholder", option, e.Message, f)
		}
	}
}
