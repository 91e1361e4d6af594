//! `tandem serve --kv-memory` counts everything the KV memory holds: with
//! sparse speculation the key bounds kept beside every KV block, with a
//! draft model the draft's own cache, sized to as many tokens as the
//! target's. The listening line says how the memory was divided.
#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use tandem_core::model::synthetic::SyntheticModel;
use tandem_core::quant::WeightFormat;

/// How the server divided its KV memory: blocks, bytes per block, and the
/// bytes beside each block for speculation.
#[derive(Debug, PartialEq)]
struct Sizing {
    blocks: usize,
    block_bytes: usize,
    beside: usize,
}

/// Starts `tandem serve` with `extra`, reads its listening line and stops it.
fn sizing(model: &Path, extra: &[&str]) -> Sizing {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--backend", "cpu", "--port", "0", "--model"])
        .arg(model)
        .args(extra)
        .env("TANDEM_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tandem serve");
    let line = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|line| line.contains("http://"))
        .expect("the server printed its listening line");
    let _ = child.kill();
    let _ = child.wait();
    let number_before = |word: &str| -> usize {
        let at = line
            .find(word)
            .unwrap_or_else(|| panic!("no `{word}` in: {line}"));
        let words: Vec<&str> = line[..at].split_whitespace().collect();
        words.last().unwrap().parse().unwrap()
    };
    Sizing {
        blocks: number_before(" KV blocks"),
        block_bytes: number_before(" bytes"),
        beside: match line.contains("beside each") {
            true => number_before(" bytes beside each"),
            false => 0,
        },
    }
}

#[test]
fn kv_memory_is_shared_with_what_speculation_keeps_beside_each_block() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let model = SyntheticModel::preset("tiny", WeightFormat::Q8_0, 5).unwrap();
    model.write_gguf(&path).unwrap();
    let c = &model.config;
    let memory = 1 << 20;
    let base = ["--kv-memory", "1MiB", "--kv-dtype", "f16"];
    let with = |more: &[&str]| sizing(&path, &[&base[..], more].concat());

    let plain = with(&[]);
    let block_bytes = 2 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 16;
    assert_eq!(plain.block_bytes, block_bytes);
    assert_eq!((plain.blocks, plain.beside), (memory / block_bytes, 0));

    // Key bounds: every layer's minimum and maximum per key channel, f32.
    let sparse = with(&["--speculate", "sparse"]);
    let bounds = 2 * 4 * c.num_layers * c.num_kv_heads * c.head_dim;
    assert_eq!(sparse.beside, bounds);
    assert_eq!(sparse.blocks, memory / (block_bytes + bounds));

    // A draft of one layer keeps its own F16 cache for as many tokens.
    let draft = with(&["--speculate", "self:0"]);
    assert_eq!(draft.beside, block_bytes / c.num_layers);
    assert_eq!(
        draft.blocks,
        memory / (block_bytes + block_bytes / c.num_layers)
    );

    // A block count given outright stays as given; n-gram lookup keeps no KV.
    let counted = with(&["--speculate", "sparse", "--kv-blocks", "7"]);
    assert_eq!((counted.blocks, counted.beside), (7, bounds));
    assert_eq!(with(&["--speculate", "ngram"]), plain);
}
