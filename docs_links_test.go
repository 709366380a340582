package caddyktls

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
)

// docFiles returns the Markdown files users read: README.md, CHANGELOG.md
// and every .md file under docs/ and examples/.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md", "CHANGELOG.md"}
	for _, dir := range []string{"docs", "examples"} {
		err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() && strings.HasSuffix(path, ".md") {
				files = append(files, path)
			}
			return err
		})
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	return files
}

// githubSlug is the anchor GitHub gives a heading: lower case, every
// character but letters, digits, spaces, '-' and '_' dropped, spaces made
// hyphens.
func githubSlug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// markdownAnchors returns the anchors of the headings of a Markdown file
// (a repeated heading gets -1, -2, … as on GitHub), outside code blocks.
func markdownAnchors(t *testing.T, file string) map[string]bool {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	anchors := map[string]bool{}
	seen := map[string]int{}
	fenced := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
			continue
		}
		if fenced || !strings.HasPrefix(line, "#") {
			continue
		}
		text := strings.TrimLeft(line, "#")
		if !strings.HasPrefix(text, " ") {
			continue
		}
		slug := githubSlug(strings.TrimSpace(text))
		if n := seen[slug]; n > 0 {
			anchors[slug+"-"+strconv.Itoa(n)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	}
	return anchors
}

var (
	// A Markdown link or image: [text](target) with a target of no spaces.
	mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	// A file of this repository named with a section in the operator kit's
	// texts (alert descriptions, dashboard panels, the systemd unit):
	// README.md#troubleshooting, docs/deploy.md#alerts.
	kitRef = regexp.MustCompile(`\b((?:docs/(?:[A-Za-z0-9_-]+/)*)?[A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)`)
)

// checkTarget checks that target (a path relative to the file at from,
// optionally with #anchor) exists, and its anchor too.
func checkTarget(t *testing.T, where, from, target string, anchors map[string]map[string]bool) {
	t.Helper()
	path, anchor, _ := strings.Cut(target, "#")
	file := from
	if path != "" {
		file = filepath.Join(filepath.Dir(from), path)
		if _, err := os.Stat(file); err != nil {
			t.Errorf("%s: link to %s: no such file (%s)", where, target, file)
			return
		}
	}
	if anchor == "" {
		return
	}
	if !strings.HasSuffix(file, ".md") {
		return // a line anchor into a source file (#L10)
	}
	if anchors[file] == nil {
		anchors[file] = markdownAnchors(t, file)
	}
	if !anchors[file][anchor] {
		t.Errorf("%s: link to %s: %s has no heading with the anchor #%s", where, target, file, anchor)
	}
}

// TestDocLinks checks every relative link in README.md, CHANGELOG.md,
// docs/ and examples/ (the file exists; a #section is a heading of it),
// and every README.md#section or docs/….md#section that the operator kit
// under deploy/ and the examples name in their text.
func TestDocLinks(t *testing.T) {
	anchors := map[string]map[string]bool{}
	links := 0
	for _, file := range docFiles(t) {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		fenced := false
		for n, line := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(line, "```") {
				fenced = !fenced
			}
			if fenced {
				continue
			}
			for _, m := range mdLink.FindAllStringSubmatch(line, -1) {
				target := strings.Trim(m[1], "<>")
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				links++
				checkTarget(t, file+":"+strconv.Itoa(n+1), file, target, anchors)
			}
		}
	}
	if links < 20 {
		t.Fatalf("found %d relative links; the scan is broken", links)
	}
	// The operator kit and the examples name README and docs sections from
	// the repository's root.
	var kit []string
	for _, dir := range []string{"deploy", "examples"} {
		filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() && !strings.HasSuffix(path, ".go") {
				kit = append(kit, path)
			}
			return nil
		})
	}
	for _, file := range kit {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range strings.Split(string(data), "\n") {
			for _, m := range kitRef.FindAllStringSubmatch(line, -1) {
				checkTarget(t, file+":"+strconv.Itoa(n+1), "x", m[1]+"#"+m[2], anchors)
			}
		}
	}
}

func TestGithubSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Troubleshooting":    "troubleshooting",
		"Is kTLS really on?": "is-ktls-really-on",
		"`sandbox` options":  "sandbox-options",
		"Caddy's own HTTPS on kernel TLS (listener wrapper)":            "caddys-own-https-on-kernel-tls-listener-wrapper",
		"The sandbox forwarder (caddy-l4)":                              "the-sandbox-forwarder-caddy-l4",
		"`ktls` (layer4 handler) and `ktls` (listener wrapper) options": "ktls-layer4-handler-and-ktls-listener-wrapper-options",
	} {
		if got := githubSlug(in); got != want {
			t.Errorf("githubSlug(%q) = %q, want %q", in, got, want)
		}
	}
}
