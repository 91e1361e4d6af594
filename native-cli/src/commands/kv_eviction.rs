//! The KV eviction flags of `run`, `chat`, `serve`, `perplexity` and
//! `bench`: `--kv-budget TOKENS|PCT%` turns eviction on, `--kv-evict`,
//! `--kv-sinks` and `--kv-recent` tune it (and are refused without a budget,
//! rather than parsed and ignored).

use anyhow::{bail, Result};
use clap::Args;
use tandem_core::kv::eviction::DEFAULT_SINKS;
use tandem_core::kv::{EvictionConfig, EvictionPolicy, KvBudget};

#[derive(Args, Clone, Debug, Default)]
pub struct KvEvictionArgs {
    /// Most KV each sequence keeps, in tokens or percent of the context
    /// (e.g. 1024 or 25%): whole KV blocks beyond it are evicted.
    #[arg(long, value_name = "TOKENS|PCT%", value_parser = parse_budget)]
    pub kv_budget: Option<KvBudget>,
    /// Which blocks leave first: h2o (least attention received), snapkv
    /// (the prompt's blocks by least attention from its last queries,
    /// chosen once the prompt is computed; generated blocks only once no
    /// prompt block is left, oldest first) or streaming (oldest). Default
    /// h2o.
    #[arg(long, value_name = "POLICY", value_parser = parse_policy)]
    pub kv_evict: Option<EvictionPolicy>,
    /// First tokens always kept (attention sinks); default 4.
    #[arg(long, value_name = "N")]
    pub kv_sinks: Option<usize>,
    /// Last tokens always kept (the recent window); default half the blocks
    /// the sinks leave of the budget.
    #[arg(long, value_name = "N")]
    pub kv_recent: Option<usize>,
}

fn parse_budget(text: &str) -> std::result::Result<KvBudget, String> {
    text.parse().map_err(|e: tandem_core::Error| reason(e))
}

fn parse_policy(text: &str) -> std::result::Result<EvictionPolicy, String> {
    text.parse().map_err(|e: tandem_core::Error| reason(e))
}

fn reason(e: tandem_core::Error) -> String {
    match e {
        tandem_core::Error::InvalidRequest(reason) => reason,
        other => other.to_string(),
    }
}

impl KvEvictionArgs {
    /// The engine's eviction, `None` without `--kv-budget`.
    pub fn config(&self) -> Result<Option<EvictionConfig>> {
        let Some(budget) = self.kv_budget else {
            let set = [
                ("--kv-evict", self.kv_evict.is_some()),
                ("--kv-sinks", self.kv_sinks.is_some()),
                ("--kv-recent", self.kv_recent.is_some()),
            ];
            if let Some((flag, _)) = set.iter().find(|(_, on)| *on) {
                bail!("{flag} needs --kv-budget (without a budget nothing is evicted)");
            }
            return Ok(None);
        };
        Ok(Some(EvictionConfig {
            budget,
            policy: self.kv_evict.unwrap_or(EvictionPolicy::H2o),
            sinks: self.kv_sinks.unwrap_or(DEFAULT_SINKS),
            recent: self.kv_recent,
        }))
    }

    /// For reports: `h2o, budget 25%, 4 sinks, recent 64` or `off`.
    pub fn describe(&self) -> String {
        match self.config() {
            Ok(Some(c)) => {
                let recent = c.recent.map_or("default".into(), |r| r.to_string());
                format!(
                    "{}, budget {}, {} sinks, recent {recent}",
                    c.policy, c.budget, c.sinks
                )
            }
            _ => "off".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kv: KvEvictionArgs,
    }

    fn parse(args: &[&str]) -> std::result::Result<KvEvictionArgs, String> {
        let argv = std::iter::once("tandem").chain(args.iter().copied());
        Cli::try_parse_from(argv)
            .map(|c| c.kv)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn flags_become_the_engine_config() {
        let kv = parse(&[
            "--kv-budget",
            "25%",
            "--kv-evict",
            "snapkv",
            "--kv-sinks",
            "2",
        ])
        .unwrap();
        let c = kv.config().unwrap().unwrap();
        assert_eq!(c.budget, KvBudget::Percent(25.0));
        assert_eq!(
            (c.policy, c.sinks, c.recent),
            (EvictionPolicy::SnapKv, 2, None)
        );
        assert!(parse(&[]).unwrap().config().unwrap().is_none());
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (args, flag) in [
            (&["--kv-budget", "lots"][..], "--kv-budget"),
            (&["--kv-budget", "0"][..], "--kv-budget"),
            (&["--kv-budget", "120%"][..], "--kv-budget"),
            (
                &["--kv-budget", "64", "--kv-evict", "lru"][..],
                "--kv-evict",
            ),
            (
                &["--kv-budget", "64", "--kv-sinks", "many"][..],
                "--kv-sinks",
            ),
            (&["--kv-budget", "64", "--kv-recent=-8"][..], "--kv-recent"),
        ] {
            let err = parse(args).unwrap_err();
            assert!(err.contains(flag), "{args:?}: {err}");
        }
        let err = parse(&["--kv-recent", "8"]).unwrap().config().unwrap_err();
        assert!(err.to_string().contains("--kv-recent"), "{err}");
    }
}
