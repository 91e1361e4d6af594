//! The throughput–latency plot: output tokens/s (x) against p99 end-to-end
//! latency (y), one line per batching mode through its rates, as SVG
//! written by hand (no plotting crate).

use std::fmt::Write;

use super::drivers::Mode;
use super::report::Summary;
use super::workload::Rate;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 460.0;
/// Plot area inside the margins (left, top, right, bottom).
const LEFT: f64 = 80.0;
const TOP: f64 = 50.0;
const RIGHT: f64 = WIDTH - 170.0;
const BOTTOM: f64 = HEIGHT - 60.0;
/// About this many grid intervals per axis.
const TICKS: f64 = 5.0;

const MODES: [(Mode, &str); 2] = [(Mode::Continuous, "#1f77b4"), (Mode::Static, "#d62728")];

/// An SVG document titled `title`; each point is labelled with its rate.
pub fn svg(summaries: &[Summary], title: &str) -> String {
    let points: Vec<(&Summary, f64, f64)> = summaries
        .iter()
        .map(|s| (s, s.output_tokens_per_s, s.e2e_latency_p99_s))
        .filter(|(_, x, y)| x.is_finite() && y.is_finite())
        .collect();
    let x = Axis::covering(points.iter().map(|p| p.1).fold(0.0, f64::max));
    let y = Axis::covering(points.iter().map(|p| p.2).fold(0.0, f64::max));
    let (x_max, y_max) = (x.max(), y.max());
    let px = |x: f64| LEFT + (RIGHT - LEFT) * x / x_max;
    let py = |y: f64| BOTTOM - (BOTTOM - TOP) * y / y_max;

    let mut out = String::new();
    let mut labels = Labels::default();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="14">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    // Grid, ticks and axis titles.
    for v in x.ticks() {
        let _ = writeln!(
            out,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{BOTTOM}" stroke="#ddd"/><text x="{0:.1}" y="{1}" text-anchor="middle">{2}</text>"##,
            px(v),
            BOTTOM + 18.0,
            number(v)
        );
    }
    for v in y.ticks() {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{RIGHT}" y2="{0:.1}" stroke="#ddd"/><text x="{1}" y="{2:.1}" text-anchor="end">{3}</text>"##,
            py(v),
            LEFT - 8.0,
            py(v) + 4.0,
            number(v)
        );
    }
    let _ = writeln!(
        out,
        r#"<rect x="{LEFT}" y="{TOP}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        RIGHT - LEFT,
        BOTTOM - TOP
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">output tokens/s</text>"#,
        (LEFT + RIGHT) / 2.0,
        HEIGHT - 20.0
    );
    let _ = writeln!(
        out,
        r#"<text x="20" y="{0}" text-anchor="middle" transform="rotate(-90 20 {0})">p99 end-to-end latency (s)</text>"#,
        (TOP + BOTTOM) / 2.0
    );
    // One line per mode through its rates, in the order they ran, and a legend entry.
    for (row, (mode, colour)) in MODES.iter().enumerate() {
        let mine: Vec<&(&Summary, f64, f64)> =
            points.iter().filter(|p| p.0.mode == *mode).collect();
        if mine.is_empty() {
            continue;
        }
        let path: Vec<String> = mine
            .iter()
            .map(|(_, x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for (s, x, y) in mine {
            let (cx, cy) = (px(*x), py(*y));
            let text = rate_label(s.rate);
            let (tx, ty, anchor) = labels.place(cx, cy, &text);
            let _ = writeln!(
                out,
                r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="4" fill="{colour}"/><text x="{tx:.1}" y="{ty:.1}" text-anchor="{anchor}" fill="{colour}">{text}</text>"#,
            );
        }
        let ly = TOP + 20.0 + 22.0 * row as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="{colour}" stroke-width="2"/><text x="{3}" y="{4}">{5} batching</text>"#,
            RIGHT + 16.0,
            ly,
            RIGHT + 40.0,
            RIGHT + 46.0,
            ly + 4.0,
            mode.name()
        );
    }
    out.push_str("</svg>\n");
    out
}

/// An axis from 0 in round steps (1, 2, 2.5 or 5 times a power of ten),
/// about `TICKS` of them, the last at or above the largest value.
struct Axis {
    step: f64,
    steps: usize,
}

impl Axis {
    fn covering(max: f64) -> Self {
        if max.is_nan() || max <= 0.0 {
            return Self {
                step: 1.0,
                steps: 1,
            };
        }
        let raw = max / TICKS;
        let power = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 2.5, 5.0, 10.0]
            .iter()
            .map(|m| m * power)
            .find(|step| *step >= raw)
            .unwrap_or(10.0 * power);
        Self {
            step,
            steps: ((max / step).ceil() as usize).max(1),
        }
    }

    fn max(&self) -> f64 {
        self.step * self.steps as f64
    }

    fn ticks(&self) -> impl Iterator<Item = f64> + '_ {
        (0..=self.steps).map(|k| self.step * k as f64)
    }
}

/// A tick label without float noise (0.30000000000000004 → 0.3).
fn number(x: f64) -> String {
    let text = format!("{x:.6}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Point labels placed beside their points where they overlap no label
/// placed before (rates close in throughput and latency crowd together).
#[derive(Default)]
struct Labels {
    /// Boxes taken: left, top, right, bottom.
    taken: Vec<[f64; 4]>,
}

impl Labels {
    /// Offsets from the point to try, in order: right or left of it
    /// (the text's anchor), above or below, then further out.
    const SPOTS: [(f64, f64, &'static str); 8] = [
        (6.0, -6.0, "start"),
        (6.0, 14.0, "start"),
        (-6.0, -6.0, "end"),
        (-6.0, 14.0, "end"),
        (6.0, -20.0, "start"),
        (6.0, 28.0, "start"),
        (-6.0, -20.0, "end"),
        (-6.0, 28.0, "end"),
    ];

    /// Where `text` goes for the point at `(x, y)`: its anchor point and side.
    fn place(&mut self, x: f64, y: f64, text: &str) -> (f64, f64, &'static str) {
        // About 7 px per character at the 12 px font.
        let width = 7.0 * text.chars().count() as f64;
        let bbox = |(dx, dy, anchor): (f64, f64, &str)| {
            let (tx, ty) = (x + dx, y + dy);
            let left = if anchor == "end" { tx - width } else { tx };
            [left, ty - 11.0, left + width, ty + 2.0]
        };
        let overlaps =
            |a: &[f64; 4], b: &[f64; 4]| a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3];
        let spot = Self::SPOTS
            .into_iter()
            .find(|&spot| !self.taken.iter().any(|t| overlaps(&bbox(spot), t)))
            .unwrap_or(Self::SPOTS[0]);
        self.taken.push(bbox(spot));
        (x + spot.0, y + spot.1, spot.2)
    }
}

fn rate_label(rate: Rate) -> String {
    match rate {
        Rate::PerSecond(_) => format!("{rate}/s"),
        Rate::Infinite => "inf".into(),
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
