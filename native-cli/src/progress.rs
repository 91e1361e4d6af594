//! Load progress on stderr, shown only when loading takes more than a moment.

use std::io::Write;
use std::time::{Duration, Instant};

pub struct LoadProgress {
    started: Instant,
    last_percent: Option<usize>,
    label: String,
}

impl LoadProgress {
    pub fn new(label: impl Into<String>) -> Self {
        Self {
            started: Instant::now(),
            last_percent: None,
            label: label.into(),
        }
    }

    pub fn update(&mut self, done: usize, total: usize) {
        if self.started.elapsed() < Duration::from_millis(300) || total == 0 {
            return;
        }
        let percent = done * 100 / total;
        if self
            .last_percent
            .is_none_or(|p| percent >= p + 5 || percent == 100 && p != 100)
        {
            self.last_percent = Some(percent);
            eprint!("\rloading {}: {percent:3}%", self.label);
            if percent == 100 {
                eprintln!();
            }
            let _ = std::io::stderr().flush();
        }
    }
}
