package ktls

import (
	"compress/gzip"
	"os"
	"path/filepath"
	"testing"
)

func writeConfig(t *testing.T, name, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if filepath.Ext(name) == ".gz" {
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		zw := gzip.NewWriter(f)
		if _, err := zw.Write([]byte(body)); err != nil {
			t.Fatal(err)
		}
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestReadKernelConfig(t *testing.T) {
	const head = "#\n# Automatically generated file; DO NOT EDIT.\n#\nCONFIG_NET=y\nCONFIG_INET=y\n"
	for _, tc := range []struct {
		name, file, body string
		want             KernelTLS
	}{
		{"builtin", "config-6.1.0", head + "CONFIG_TLS=y\nCONFIG_TLS_DEVICE=y\n", KernelTLSBuiltin},
		{"module", "config-6.1.0", head + "CONFIG_TLS=m\n", KernelTLSModule},
		{"not-set", "config-6.1.0", head + "# CONFIG_TLS is not set\n", KernelTLSAbsent},
		{"not-set-gz", "config.gz", head + "# CONFIG_TLS is not set\nCONFIG_TLS_TOE=y\n", KernelTLSAbsent},
		{"module-gz", "config.gz", head + "CONFIG_TLS_DEVICE=y\nCONFIG_TLS=m\n", KernelTLSModule},
		// CONFIG_NET off hides the option: no line at all, no kTLS.
		{"hidden", "config-6.1.0", head, KernelTLSAbsent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := writeConfig(t, tc.file, tc.body)
			got := ReadKernelConfig(p)
			if got.TLS != tc.want || got.Source != p {
				t.Errorf("ReadKernelConfig(%s) = %+v, want %v from %s", p, got, tc.want, p)
			}
		})
	}
}

// The first readable configuration answers; unreadable files and ones that
// are no kernel configuration are skipped, and with none left the answer
// is unknown, naming the files tried.
func TestReadKernelConfigFallback(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "config-missing")
	junk := writeConfig(t, "config-junk", "hello\n")
	badGz := writeConfig(t, "bad.gz", "not gzip")
	gz := writeConfig(t, "config.gz", "CONFIG_NET=y\n# CONFIG_TLS is not set\n")
	if got := ReadKernelConfig(missing, junk, badGz, gz); got.TLS != KernelTLSAbsent || got.Source != gz {
		t.Errorf("got %+v, want not set from %s", got, gz)
	}
	got := ReadKernelConfig(missing, junk)
	if got.TLS != KernelTLSUnknown || got.Source != missing+", "+junk {
		t.Errorf("got %+v, want unknown naming both files", got)
	}
	if s := got.TLS.String(); s != "unknown" {
		t.Errorf("String() = %q", s)
	}
}

func TestKernelConfigPaths(t *testing.T) {
	got := KernelConfigPaths("6.18.1-test")
	if len(got) != 2 || got[0] != "/boot/config-6.18.1-test" || got[1] != "/proc/config.gz" {
		t.Errorf("KernelConfigPaths = %q", got)
	}
}
