//! `tandem bench-serve`'s parts (`tandem_server::bench`) on a tiny random
//! model, timed by a simulated clock where every engine step takes one
//! second: static batches pad to their longest member and take in nobody
//! while they run, continuous batching admits each request at its arrival,
//! KV blocks all come back; the workload's Poisson arrivals and log-normal
//! lengths; the percentiles; the JSON's keys; the SVG's well-formedness.

use serde_json::Value;
use tandem_core::engine::{Engine, EngineConfig};
use tandem_core::model::ModelFiles;
use tandem_core::quant::WeightFormat;
use tandem_cpu::CpuBackend;
use tandem_server::bench::{
    self, arrival_times, percentile, BenchRequest, LogNormal, Mode, Rate, StepClock, Summary,
    WorkloadSpec,
};
use tandem_tests::{tiny, tiny_gguf};

fn engine(files: &ModelFiles, max_running: usize, num_blocks: usize) -> Engine<CpuBackend> {
    let config = EngineConfig {
        num_blocks,
        // Every batch's prompts fit one step: a batch's first step gives every member its first token.
        max_batch_tokens: 512,
        max_running,
        ..EngineConfig::default()
    };
    Engine::new(CpuBackend::new(2), files, config, &mut |_, _| {}).unwrap()
}

/// Requests of the given (prompt, output) lengths.
fn requests(lengths: &[(usize, usize)]) -> Vec<BenchRequest> {
    lengths
        .iter()
        .enumerate()
        .map(|(i, &(prompt, output_tokens))| BenchRequest {
            prompt: (0..prompt)
                .map(|t| (10 + (i * 31 + t * 7) % 300) as u32)
                .collect(),
            output_tokens,
        })
        .collect()
}

const OUTPUTS: [usize; 6] = [3, 9, 5, 2, 7, 4];
/// Requests 0 and 1 at once, 2 during the first batch, 3 and 4 later
/// during it, 5 after everything else is done.
const ARRIVALS: [f64; 6] = [0.0, 0.0, 0.5, 2.5, 2.5, 30.0];

fn staggered() -> Vec<BenchRequest> {
    requests(&OUTPUTS.map(|n| (6 + n, n)))
}

#[test]
fn static_batches_pad_to_their_longest_member_and_take_in_nobody_while_running() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 41));
    let mut e = engine(&files, 4, 64);
    let work = staggered();
    let run = bench::run(
        &mut e,
        &work,
        &ARRIVALS,
        Mode::Static,
        &mut StepClock::new(1.0),
    )
    .unwrap();

    // {0, 1} start at 0 and run 9 steps (request 1's output); 2, 3 and 4
    // arrive meanwhile and wait; {2, 3, 4} run 7 steps; 5 comes at 30.
    let shape: Vec<(Vec<usize>, f64, f64, usize, u64)> = run
        .batches
        .iter()
        .map(|b| {
            (
                b.members.clone(),
                b.started,
                b.ended,
                b.padded_output,
                b.steps,
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (vec![0, 1], 0.0, 9.0, 9, 9),
            (vec![2, 3, 4], 9.0, 16.0, 7, 7),
            (vec![5], 30.0, 34.0, 4, 4),
        ]
    );
    for b in &run.batches {
        let longest = b.members.iter().map(|&i| OUTPUTS[i]).max().unwrap();
        assert_eq!(
            b.steps as usize, longest,
            "a batch runs until its longest member ends"
        );
        for &i in &b.members {
            assert!(
                ARRIVALS[i] <= b.started,
                "request {i} joined a running batch"
            );
            let s = &run.served[i];
            assert_eq!(s.done, b.ended, "a member's latency ends with its batch");
            assert_eq!(s.first_token, b.started + 1.0);
            assert_eq!(s.output_tokens, OUTPUTS[i], "only its own tokens count");
        }
    }
    // Finished members kept decoding: every member generated the batch's longest output.
    let padded: u64 = run
        .batches
        .iter()
        .map(|b| (b.members.len() * b.padded_output) as u64)
        .sum();
    assert_eq!(run.generated_tokens, padded);
    assert_eq!(padded, 2 * 9 + 3 * 7 + 4);
    assert_eq!(run.duration, 34.0);
    assert_eq!(e.kv_manager().num_used_blocks(), 0);

    let summary = Summary::new(&run, Rate::PerSecond(1.0));
    assert_eq!(summary.output_tokens, OUTPUTS.iter().sum::<usize>());
    assert!(
        summary.kv_slots_useful_fraction < 0.9,
        "padding holds KV slots that are not output: {}",
        summary.kv_slots_useful_fraction
    );
}

#[test]
fn continuous_batching_admits_each_request_at_the_step_after_its_arrival() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 41));
    let mut e = engine(&files, 4, 64);
    let work = staggered();
    let run = bench::run(
        &mut e,
        &work,
        &ARRIVALS,
        Mode::Continuous,
        &mut StepClock::new(1.0),
    )
    .unwrap();
    assert!(run.batches.is_empty());
    // Request 2 arrives at 0.5, is handed in after the first step and has its
    // first token one step later; request 0 leaves after its own 3 tokens.
    assert_eq!(run.served[2].first_token, 2.0);
    assert_eq!(run.served[0].done, 3.0);
    for (i, s) in run.served.iter().enumerate() {
        assert_eq!(s.output_tokens, OUTPUTS[i]);
        assert!(s.first_token > s.arrival && s.done >= s.first_token);
        // Nobody waits for a slot here (4 of them, room in the pool): handed in
        // when the step under way ends, first token one step later.
        assert_eq!(s.first_token, s.arrival.ceil() + 1.0, "request {i}: {s:?}");
        assert_eq!(s.done - s.first_token, (OUTPUTS[i] - 1) as f64);
    }
    assert_eq!(run.generated_tokens, OUTPUTS.iter().sum::<usize>() as u64);
    assert_eq!(e.kv_manager().num_used_blocks(), 0);
}

#[test]
fn static_batches_are_capped_by_max_running_and_by_the_kv_pool_at_padded_length() {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 42));
    let work = requests(&[(20, 20); 6]);
    let at_once = [0.0; 6];
    let members = |e: &mut Engine<CpuBackend>| {
        let run = bench::run(e, &work, &at_once, Mode::Static, &mut StepClock::new(1.0)).unwrap();
        assert_eq!(run.preemptions, 0, "a static batch never outgrows the pool");
        assert_eq!(e.kv_manager().num_used_blocks(), 0);
        run.batches
            .iter()
            .map(|b| b.members.clone())
            .collect::<Vec<_>>()
    };
    let mut roomy = engine(&files, 4, 64);
    assert_eq!(members(&mut roomy), vec![vec![0, 1, 2, 3], vec![4, 5]]);
    // 40 tokens are 3 blocks of 16: a pool of 7 holds two such requests.
    let mut tight = engine(&files, 4, 7);
    assert_eq!(
        members(&mut tight),
        vec![vec![0, 1], vec![2, 3], vec![4, 5]]
    );
    // Continuous batching on the tight pool preempts instead, and still
    // serves everyone in full and gives every block back.
    let run = bench::run(
        &mut tight,
        &work,
        &at_once,
        Mode::Continuous,
        &mut StepClock::new(1.0),
    )
    .unwrap();
    assert!(run.served.iter().all(|s| s.output_tokens == 20));
    assert!(run.kv.peak_blocks <= 7);
    assert_eq!(tight.kv_manager().num_used_blocks(), 0);
}

#[test]
fn poisson_arrivals_have_mean_gap_one_over_the_rate_and_follow_the_seed() {
    let n = 20_000;
    let times = arrival_times(n, Rate::PerSecond(4.0), 7);
    assert_eq!(times[0], 0.0);
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.iter().all(|g| *g >= 0.0));
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    assert!((mean - 0.25).abs() < 0.25 * 0.03, "mean gap {mean}");
    // Exponential gaps: the standard deviation equals the mean.
    let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
    assert!((sd / mean - 1.0).abs() < 0.05, "sd {sd}, mean {mean}");

    assert_eq!(times, arrival_times(n, Rate::PerSecond(4.0), 7));
    assert_ne!(times, arrival_times(n, Rate::PerSecond(4.0), 8));
    // Every rate scales the same pattern.
    let twice = arrival_times(n, Rate::PerSecond(8.0), 7);
    assert!(times
        .iter()
        .zip(&twice)
        .all(|(a, b)| (a / 2.0 - b).abs() < 1e-9));
    assert!(arrival_times(5, Rate::Infinite, 7)
        .iter()
        .all(|t| *t == 0.0));
}

#[test]
fn rates_parse_from_the_command_line_form() {
    assert_eq!("inf".parse::<Rate>(), Ok(Rate::Infinite));
    assert_eq!("2.5".parse::<Rate>(), Ok(Rate::PerSecond(2.5)));
    for bad in ["0", "-1", "fast", "NaN"] {
        assert!(bad.parse::<Rate>().is_err(), "{bad}");
    }
}

#[test]
fn log_normal_samples_have_the_stated_median_and_sigma() {
    let d = LogNormal {
        median: 40.0,
        sigma: 1.2,
    };
    let mut rng = tandem_core::sched::Rng::new(3);
    let xs: Vec<f64> = (0..20_001).map(|_| d.sample(&mut rng)).collect();
    let median = percentile(&xs, 50.0);
    assert!((median / 40.0 - 1.0).abs() < 0.03, "median {median}");
    let logs: Vec<f64> = xs.iter().map(|x| x.ln()).collect();
    let mu = logs.iter().sum::<f64>() / logs.len() as f64;
    let sigma = (logs.iter().map(|l| (l - mu).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
    assert!((sigma / 1.2 - 1.0).abs() < 0.03, "sigma {sigma}");
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    assert!(
        (mean / d.mean() - 1.0).abs() < 0.06,
        "mean {mean} vs {}",
        d.mean()
    );
}

#[test]
fn workloads_are_clipped_to_the_context_and_reproducible_from_the_seed() {
    let spec = WorkloadSpec {
        requests: 500,
        prompt_tokens: LogNormal {
            median: 30.0,
            sigma: 1.0,
        },
        output_tokens: LogNormal {
            median: 20.0,
            sigma: 1.5,
        },
        system_tokens: 10,
        max_len: 200,
        vocab: 320,
        seed: 5,
    };
    let work = spec.requests().unwrap();
    assert_eq!(work.len(), 500);
    for r in &work {
        assert!((14..=100).contains(&r.prompt.len()), "{}", r.prompt.len());
        assert_eq!(
            r.prompt[..10],
            work[0].prompt[..10],
            "the shared system prompt"
        );
        assert!(r.output_tokens >= 2 && r.prompt.len() + r.output_tokens <= 200);
        assert!(r.prompt.iter().all(|&t| t < 320));
    }
    // sigma 1.5 reaches the clip (e^(1.5 * 2.33) * 20 is about 660 at the 99th percentile).
    assert!(work.iter().any(|r| r.prompt.len() + r.output_tokens == 200));
    let outputs: Vec<f64> = work.iter().map(|r| r.output_tokens as f64).collect();
    let median = percentile(&outputs, 50.0);
    assert!((15.0..=26.0).contains(&median), "median output {median}");
    assert_eq!(work, spec.requests().unwrap());
    let other = WorkloadSpec {
        seed: 6,
        ..spec.clone()
    }
    .requests()
    .unwrap();
    assert_ne!(work, other);
    let cramped = WorkloadSpec {
        system_tokens: 99,
        ..spec
    };
    assert!(cramped.requests().is_err(), "no room for a prompt");
}

#[test]
fn percentiles_interpolate_between_ranks() {
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&hundred, 50.0), 50.5);
    assert!((percentile(&hundred, 99.0) - 99.01).abs() < 1e-9);
    assert_eq!(percentile(&hundred, 0.0), 1.0);
    assert_eq!(percentile(&hundred, 100.0), 100.0);
    assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
    assert_eq!(percentile(&[3.0, 1.0, 2.0], 25.0), 1.5);
    assert_eq!(percentile(&[7.0], 99.0), 7.0);
    assert!(percentile(&[], 50.0).is_nan());
}

/// Both modes at two rates on the staggered workload.
fn sweep() -> Vec<Summary> {
    let dir = tempfile::tempdir().unwrap();
    let files = tiny_gguf(dir.path(), &tiny(WeightFormat::F32, 43));
    let mut e = engine(&files, 4, 64);
    let work = staggered();
    let mut out = Vec::new();
    for rate in [Rate::PerSecond(2.0), Rate::Infinite] {
        let arrivals = arrival_times(work.len(), rate, 1);
        for mode in [Mode::Continuous, Mode::Static] {
            let run = bench::run(&mut e, &work, &arrivals, mode, &mut StepClock::new(0.1)).unwrap();
            out.push(Summary::new(&run, rate));
        }
    }
    out
}

#[test]
fn the_json_has_one_object_per_mode_and_rate_with_the_documented_keys() {
    let summaries = sweep();
    let doc = bench::json_document(serde_json::json!({"model": "tiny"}), &summaries);
    assert_eq!(doc["setup"]["model"], "tiny");
    const NUMBERS: [&str; 20] = [
        "requests",
        "duration_s",
        "input_tokens",
        "output_tokens",
        "requests_per_s",
        "output_tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "e2e_latency_p50_s",
        "e2e_latency_p99_s",
        "kv_blocks_peak",
        "kv_blocks_mean",
        "kv_pool_blocks",
        "kv_slots_useful_fraction",
        "preemptions",
        "steps",
        "generated_tokens",
        "prefix_hit_rate",
    ];
    for mode in ["continuous", "static"] {
        let runs = doc[mode].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{mode}: one object per rate");
        assert_eq!(runs[0]["rate"], 2.0);
        assert_eq!(runs[1]["rate"], "inf");
        for run in runs {
            assert_eq!(run["mode"], mode);
            for key in NUMBERS {
                let v = run[key].as_f64();
                assert!(v.is_some_and(f64::is_finite), "{mode}.{key} = {}", run[key]);
            }
            let per_s = run["output_tokens_per_s"].as_f64().unwrap();
            let (tokens, secs) = (
                run["output_tokens"].as_f64().unwrap(),
                run["duration_s"].as_f64().unwrap(),
            );
            assert!((per_s * secs - tokens).abs() < 1e-6);
            assert!(run["ttft_p50_s"].as_f64() <= run["ttft_p99_s"].as_f64());
        }
    }
    let comparison = doc["comparison"].as_array().unwrap();
    assert_eq!(comparison.len(), 2);
    let c = &comparison[1];
    let ratio = doc["continuous"][1]["output_tokens_per_s"]
        .as_f64()
        .unwrap()
        / doc["static"][1]["output_tokens_per_s"].as_f64().unwrap();
    assert!((c["output_tokens_per_s_ratio"].as_f64().unwrap() - ratio).abs() < 1e-9);
    assert!(matches!(c["goal_met"], Value::Bool(_)));

    let table = bench::table(&summaries);
    assert_eq!(
        table
            .lines()
            .filter(|l| l.starts_with("| continuous"))
            .count(),
        2
    );
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| static")).count(),
        2
    );
}

#[test]
fn the_plot_is_well_formed_svg_with_one_line_per_mode() {
    let summaries = sweep();
    let svg = bench::plot::svg(&summaries, "tiny <random> & co");
    let elements = check_xml(&svg);
    assert_eq!(elements[0], "svg");
    assert_eq!(elements.iter().filter(|e| *e == "polyline").count(), 2);
    assert_eq!(elements.iter().filter(|e| *e == "circle").count(), 4);
    for line in svg.lines().filter(|l| l.starts_with("<polyline")) {
        let points = line
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(points.split(' ').count(), 2, "one point per rate: {line}");
        for p in points.split(' ') {
            let (x, y) = p.split_once(',').unwrap();
            assert!(x.parse::<f64>().is_ok() && y.parse::<f64>().is_ok(), "{p}");
        }
    }
    assert!(svg.contains("tiny &lt;random&gt; &amp; co"));
}

/// Checks `text` is well-formed XML as far as the plot needs (tags nest and
/// close, attributes are quoted, text holds no raw `<` or `&`); returns the
/// element names in document order.
fn check_xml(text: &str) -> Vec<String> {
    let mut open: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('<') {
        check_text(&rest[..start]);
        let end = rest[start..].find('>').expect("an unclosed tag") + start;
        let tag = &rest[start + 1..end];
        rest = &rest[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                open.pop().as_deref(),
                Some(name.trim()),
                "mismatched </{name}>"
            );
            continue;
        }
        let self_closing = tag.ends_with('/');
        let body = tag.trim_end_matches('/');
        let name = body.split_whitespace().next().expect("a tag name");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == ':'),
            "bad name {name:?}"
        );
        assert!(
            !open.is_empty() || names.is_empty(),
            "a second root element"
        );
        let attrs = &body[name.len()..];
        assert_eq!(
            attrs.matches('"').count() % 2,
            0,
            "unbalanced quotes in <{tag}>"
        );
        for pair in attrs.split('"').step_by(2).filter(|s| !s.trim().is_empty()) {
            assert!(
                pair.trim().ends_with('='),
                "an unquoted attribute in <{tag}>"
            );
        }
        names.push(name.to_string());
        if !self_closing {
            open.push(name.to_string());
        }
    }
    check_text(rest);
    assert!(open.is_empty(), "unclosed elements {open:?}");
    names
}

fn check_text(text: &str) {
    for (i, _) in text.match_indices('&') {
        let entity = &text[i..];
        assert!(
            ["&amp;", "&lt;", "&gt;", "&quot;"]
                .iter()
                .any(|e| entity.starts_with(e)),
            "a raw & in {text:?}"
        );
    }
}
