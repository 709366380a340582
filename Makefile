# caddy-ktls: build, demo and test entry points. `make help` lists them.
GO ?= go
# The kernel matrix of `make test` (names: 6.1 bookworm, 6.12 trixie, 7.3
# trixie-backports). 6.12 is left out by default to keep CI under 30 minutes
# on 2 cores: make test KERNELS="6.1 6.12 7.3".
KERNELS ?= 6.1 7.3
# One kernel for `make vmtest` and the demo.
KERNEL ?= 6.1
DEMO_KERNEL ?= 7.3
# MiB the demo sends through the tunnel inside the (slow, emulated) VM.
DEMO_VM_MIB ?= 4
# Flags of the host test run (-race roughly doubles its time; see docs/testing.md).
HOST_TEST_FLAGS ?= -race
XCADDY_VERSION = v0.4.5
CADDY_VERSION = v2.11.9
CADDY_L4_VERSION = v0.1.2
# Transfer size (MiB) of the kernel tests in the VM; empty = each test's default.
export KTLS_TEST_MIB
# Size (MiB) of the real-binary test's curl download; empty = KTLS_TEST_MIB's.
export KTLS_BINARY_DOWNLOAD_MIB

.PHONY: help build tools xcaddy demo test vet hosttest fuzz vmtest flake bench bench-smoke bench-load bench-ttfb bench-bulk bench-gateway bench-host bench-report clean

help:
	@echo 'make build        bin/caddy: Caddy + caddy-l4 + caddy-ktls (plain go build of cmd/caddy)'
	@echo 'make tools        bin/h2spec, the HTTP/2 conformance suite the wrapper is compared with stock Caddy by (pinned: integration/tools/go.mod)'
	@echo 'make xcaddy       bin/caddy-xcaddy with xcaddy $(XCADDY_VERSION), and check it carries this module'
	@echo 'make demo         a sandbox tunnel end to end on this host, then in a VM on kernel $(DEMO_KERNEL)'
	@echo 'make test         go vet, host tests ($(HOST_TEST_FLAGS)), kernel tests in VMs on: $(KERNELS), bench smoke'
	@echo 'make fuzz         every fuzz target for $(FUZZTIME) executions (FUZZTIME=10m for a real run)'
	@echo 'make vmtest KERNEL=6.1|6.12|7.3   kernel tests on one kernel'
	@echo "make flake KERNEL=7.3|6.1|6.12|host RUN='^TestKernelSandbox' COUNT=10   rerun tests COUNT times in one VM (or on the host with $(HOST_TEST_FLAGS)), failures counted per test"
	@echo 'make bench        every forwarder contender, every shape, in two 7.3 VMs under qemu -icount: docs/bench/results.md'
	@echo 'make bench-smoke  the same at a tiny size, once each, in VMs and natively, and the load and time-to-first-byte runs at a tiny size: fails on any wrong byte or data path'
	@echo 'make bench-load   the open-loop load run (capacity, latency per offered rate, fairness) in a real-time two-vCPU 6.1 VM: docs/bench/load.md'
	@echo 'make bench-ttfb   time to first byte through l7-l7, l4-l4 and l4-l4 with standby, netem at 1, 20 and 100 ms RTT between gateway and forwarder, in a real-time two-vCPU 6.1 VM: docs/bench/ttfb.md'
	@echo 'make bench-bulk   1 GiB upload and download per contender, two VMs side by side: docs/bench/bulk-1gib.md'
	@echo 'make bench-gateway the edge-gateway paths (l7-l7, l7-l4, l4-l4) in a 7.3 VM: docs/bench/gateway.md'
	@echo 'make bench-host   native Go benchmarks (relay, handshake, preamble) on this host: docs/bench/host.md'
	@echo 'make bench-report re-renders docs/bench/results.md, bulk-1gib.md, gateway.md and their charts from the JSON'
	@echo 'make clean        remove bin/ and the harness build dir'

# Built beside bin/caddy and renamed over it: a VM running it from this
# checkout (9p) never sees a half-written binary.
build:
	$(GO) build -o bin/.caddy.tmp ./cmd/caddy && mv bin/.caddy.tmp bin/caddy

# Test tools at the versions integration/tools/go.mod pins, from the module
# proxy: h2spec for TestListenerWrapperConformance (host and VM).
tools: bin/h2spec
bin/h2spec: integration/tools/go.mod integration/tools/go.sum
	cd integration/tools && $(GO) build -o ../../bin/h2spec github.com/summerwind/h2spec/cmd/h2spec

# The user's path to a Caddy with this module: the exact xcaddy command, with
# the module proxy only (no VCS fallback) so that it resolves what go.sum pins.
xcaddy: build
	@command -v xcaddy >/dev/null 2>&1 || [ -x "$$($(GO) env GOPATH)/bin/xcaddy" ] || \
		$(GO) install github.com/caddyserver/xcaddy/cmd/xcaddy@$(XCADDY_VERSION)
	@start=$$(date +%s); \
	PATH="$$PATH:$$($(GO) env GOPATH)/bin" GOPROXY="$$($(GO) env GOPROXY | cut -d, -f1)|off" \
		xcaddy build $(CADDY_VERSION) --with github.com/mholt/caddy-l4@$(CADDY_L4_VERSION) --with github.com/ktlsingress/caddy-ktls=. && \
	mv caddy bin/caddy-xcaddy && \
	echo "xcaddy build took $$(( $$(date +%s) - start ))s"
	integration/xcaddy-check.sh bin/caddy-xcaddy bin/caddy

demo: build
	$(GO) build -o bin/demo-upstream ./examples/demo-upstream
	@echo '=== the sandbox data path on this host ($(shell uname -r))'
	DEMO_PREBUILT=1 examples/demo.sh
	@echo '=== the same in a VM on kernel $(DEMO_KERNEL), which has kTLS'
	integration/vm.sh $(DEMO_KERNEL) 'DEMO_PREBUILT=1 DEMO_REQUIRE_KERNEL=1 DEMO_MIB=$(DEMO_VM_MIB) examples/demo.sh'

# The bench smoke runs its contenders in two VMs side by side, so the split
# and the merged report (what bench-bulk uses) run in CI too; then natively,
# so the harness's --native mode (item 9 of issue 7) does not rot either.
# The edge-gateway chains (l7-l7, l7-l4, l4-l4: two Caddy processes each)
# add about half a minute to each VM.
BENCH_SMOKE_SPLIT = ktls,ktls-rx-off,ktls-off,floor-ktls,floor-plain,floor-rw-plain,l4-l4 l4-proxy,reverse-proxy,haproxy,nginx,floor-rw-ktls,l7-l7,l7-l4
# Then once more with a gateway that seals in its kernel (-gateway-ktls),
# through one contender of each way the gateway dials: preamble, TLS, HTTPS.
BENCH_SMOKE_GATEWAY_KTLS = ktls,l4-proxy,reverse-proxy
# bench and bench-bulk run two VMs side by side: the headline contenders
# share one (the goals' ratios come from one run), the others the second.
BENCH_VM_SPLIT = ktls,floor-ktls,floor-rw-ktls,l4-proxy,reverse-proxy ktls-rx-off,ktls-off,haproxy,nginx,floor-plain,floor-rw-plain

test: vet hosttest fuzz build tools
	integration/vmtest.sh $(KERNELS)
	$(MAKE) --no-print-directory bench-smoke

vet:
	$(GO) vet ./...

hosttest: tools
	integration/hosttest.sh $(HOST_TEST_FLAGS)

# A short run of every fuzz target: the parsers that face the network, the
# decoders of the states an upgrade moves, and the Caddyfile unmarshalers. FuzzCaddyfile needs a coverage-instrumented
# build of all of Caddy (5.4 min cold on an idle 2-core machine, cached
# after). The smoke is a count of executions, not a duration: with a
# duration, Go 1.26's fuzz coordinator can report its own deadline as a
# failure ("context deadline exceeded", golang/go#75804, fixed in Go 1.27).
# FUZZTIME=10m for a real run.
FUZZTIME ?= 20000x
FUZZ_TARGETS = ./ktls:FuzzRecordReader ./ktls:FuzzRecordOpen ./ktls:FuzzControlRecord ./preamble:FuzzParse \
	./internal/wire:FuzzReader ./ktls:FuzzHandoffState ./splice:FuzzPauseState ./forward:FuzzMovedTunnel ./gateway:FuzzMovedTunnel \
	.:FuzzCaddyfile
fuzz:
	@for t in $(FUZZ_TARGETS); do \
		echo "=== fuzz $${t#*:} in $${t%%:*} for $(FUZZTIME)"; \
		$(GO) test -run '^$$' -fuzz "^$${t#*:}$$" -fuzztime $(FUZZTIME) $${t%%:*} || exit 1; \
	done

vmtest: build tools
	integration/vmtest.sh $(KERNEL)

# Finds a flaky test in minutes: the tests matching RUN, COUNT times in a row
# in one VM on KERNEL (each binary's log ends with "flake: TestX 3/10
# failed"), or with KERNEL=host, in every package on this host with
# HOST_TEST_FLAGS. HOG=1 keeps every core busy meanwhile (a loaded CI box).
RUN ?= ^TestKernel
COUNT ?= 10
HOG ?= 0
flake: build tools
	integration/flake.sh '$(KERNEL)' '$(RUN)' '$(COUNT)' '$(HOG)' $(HOST_TEST_FLAGS)

# The benchmark harness (integration/bench.sh builds its own Caddy and the
# driver). bench has the sizes of the committed docs/bench/results.md: every
# shape, 16 MiB per bulk run (bench-bulk has the 1 GiB ones), 3 repetitions;
# the structural passes at the driver's 16 MiB, as in bench-bulk.
bench:
	BENCH_BULK_MIB=16 BENCH_SPLIT='$(BENCH_VM_SPLIT)' integration/bench.sh \
		-small-calls 2000 -small-per-call-calls 100 -structural-calls 100

bench-smoke:
	BENCH_SPLIT='$(BENCH_SMOKE_SPLIT)' integration/bench.sh --smoke
	BENCH_OUT=$${KTLS_BUILD_DIR:-integration/.build}/bench/smoke-gateway-ktls/results.json \
		integration/bench.sh --smoke -gateway-ktls -contenders $(BENCH_SMOKE_GATEWAY_KTLS)
	integration/bench.sh --native --smoke
	integration/bench.sh --load --smoke
	integration/bench.sh --ttfb --smoke

# The open-loop load run of issue 34 (docs/bench/load.md): every load
# contender, both shapes, 10,000 tunnels to 1,000 targets, the capacity
# search and the sweep, the bulk mix; hours under TCG (BENCH_LOAD_LABEL and
# driver flags make a reduced run, see docs/bench/load.md).
bench-load:
	integration/bench.sh --load

# A new connection's time to first byte through the gateway chains with
# netem between gateway and forwarder (issue 34, docs/bench/ttfb.md): 40
# connections per chain at each of 1, 20 and 100 ms RTT, about 5 minutes.
bench-ttfb:
	integration/bench.sh --ttfb

bench-bulk:
	BENCH_BULK_MIB=1024 BENCH_SPLIT='$(BENCH_VM_SPLIT)' BENCH_OUT=docs/bench/bulk-1gib.json \
		integration/bench.sh -shapes upload,download

# The edge-gateway paths of issue 19: the three chains share one VM (their
# ratios come from one run), ktls and reverse_proxy beside them for
# reference; 47 minutes on two cores (the chains' VM, structural passes
# included).
GATEWAY_JSON = docs/bench/gateway-results-1.json,docs/bench/gateway-results-2.json
bench-gateway:
	BENCH_BULK_MIB=64 BENCH_REPS=3 BENCH_SPLIT='l7-l7,l7-l4,l4-l4 ktls,reverse-proxy' BENCH_OUT=docs/bench/gateway-results.json \
		integration/bench.sh
	$(GO) run ./integration/benchreport gateway -in $(GATEWAY_JSON) -md docs/bench/gateway.md -full gateway-results.md

bench-host:
	integration/bench-host.sh

bench-report:
	$(GO) run ./integration/benchreport results -in docs/bench/results-1.json,docs/bench/results-2.json \
		-md docs/bench/results.md -png docs/bench/results.png
	$(GO) run ./integration/benchreport results -in docs/bench/bulk-1gib-1.json,docs/bench/bulk-1gib-2.json \
		-md docs/bench/bulk-1gib.md -png docs/bench/bulk-1gib.png
	$(GO) run ./integration/benchreport results -in $(GATEWAY_JSON) -md docs/bench/gateway-results.md -png docs/bench/gateway-results.png
	$(GO) run ./integration/benchreport gateway -in $(GATEWAY_JSON) -md docs/bench/gateway.md -full gateway-results.md

clean:
	rm -rf bin integration/.build
