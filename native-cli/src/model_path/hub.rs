//! `hf:ORG/REPO[:SELECTOR]`: files from the Hugging Face hub through
//! hf-hub's blocking client, into the hub's own cache (`$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), where Python's `huggingface_hub` finds them
//! too. hf-hub reads `HF_HOME`, `HF_ENDPOINT` and the token file; this adds
//! `HF_TOKEN` and `HF_HUB_OFFLINE`, retries that resume (hf-hub continues
//! the partial `blobs/ETAG.part` with a Range request, in this run or the
//! next), a sha256 check of each LFS file against its etag (which is its
//! sha256), and errors that say what to do.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo};

use super::checksum::sha256_hex;
use super::hub_select::{index_shards, select, HubSpec, Selection};
use super::{env_flag, OFFLINE_VAR};

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const TOKEN_VAR: &str = "HF_TOKEN";
const HUB_OFFLINE_VAR: &str = "HF_HUB_OFFLINE";
/// Further attempts after an interrupted download. Each is a fresh hf-hub
/// download, which continues the partial file from its length: hf-hub's own
/// retries resume from the wrong offset when an attempt wrote nothing, and
/// drop the result of the last one.
const RETRIES: usize = 3;
const RETRY_PAUSE: Duration = Duration::from_millis(300);

/// Downloads what `spec` names (unless cached) and returns the GGUF file
/// or the Hugging Face directory to load.
pub fn resolve(spec: &HubSpec) -> Result<PathBuf> {
    let hub = Hub::new(&spec.repo)?;
    let files = hub.list()?;
    let selection = select(spec, &files).map_err(|e| {
        if hub.offline {
            e.context(format!(
                "{HUB_OFFLINE_VAR} or {OFFLINE_VAR} is set, so only the cached files count"
            ))
        } else {
            e
        }
    })?;
    match selection {
        Selection::Gguf(file) => hub.fetch(&file),
        Selection::HfDir { files, indexed } => {
            let mut paths = Vec::new();
            for file in &files {
                paths.push(hub.fetch(file)?);
            }
            if indexed {
                let index = paths.last().expect("the index is selected last");
                let text = std::fs::read_to_string(index)
                    .with_context(|| format!("reading {}", index.display()))?;
                for shard in index_shards(&text)? {
                    hub.fetch(&shard)?;
                }
            }
            let config = &paths[0];
            Ok(config.parent().unwrap_or(Path::new(".")).to_path_buf())
        }
    }
}

/// One repo on the hub and in the local cache.
struct Hub {
    repo_id: String,
    api: ApiRepo,
    cache: Cache,
    repo: Repo,
    endpoint: String,
    offline: bool,
    has_token: bool,
}

impl Hub {
    fn new(repo_id: &str) -> Result<Self> {
        let cache = Cache::from_env();
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let token = std::env::var(TOKEN_VAR)
            .ok()
            .filter(|t| !t.trim().is_empty())
            .map(|t| t.trim().to_string())
            .or_else(|| cache.token());
        let has_token = token.is_some();
        let api = ApiBuilder::from_cache(cache.clone())
            .with_endpoint(endpoint.clone())
            .with_token(token)
            .with_user_agent("tandem", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| anyhow!("setting up the hub client: {e}"))?;
        let repo = Repo::model(repo_id.to_string());
        Ok(Self {
            repo_id: repo_id.to_string(),
            api: api.repo(repo.clone()),
            cache,
            repo,
            endpoint,
            offline: env_flag(HUB_OFFLINE_VAR) || env_flag(OFFLINE_VAR),
            has_token,
        })
    }

    /// The repo's files: from the hub, else (offline, or the hub out of
    /// reach) from the cached snapshot.
    fn list(&self) -> Result<Vec<String>> {
        if self.offline {
            return self.cached_files().with_context(|| {
                format!("{HUB_OFFLINE_VAR} or {OFFLINE_VAR} is set, so only the cache is used")
            });
        }
        match self.api.info() {
            Ok(info) => Ok(info.siblings.into_iter().map(|s| s.rfilename).collect()),
            Err(ApiError::RequestError(e)) if matches!(*e, ureq::Error::Transport(_)) => {
                let unreachable = self.explain(ApiError::RequestError(e), None);
                match self.cached_files() {
                    Ok(files) => {
                        eprint_line!("warning: {unreachable:#}; using the cached snapshot");
                        Ok(files)
                    }
                    Err(_) => Err(unreachable),
                }
            }
            Err(e) => Err(self.explain(e, None)),
        }
    }

    /// The cached file, else downloads it (resuming a partial download).
    fn fetch(&self, file: &str) -> Result<PathBuf> {
        if let Some(path) = self.cache.repo(self.repo.clone()).get(file) {
            return Ok(path);
        }
        if self.offline {
            bail!(
                "{file} of {} is not cached in {} and {HUB_OFFLINE_VAR} or {OFFLINE_VAR} is set",
                self.repo_id,
                self.cache.path().display()
            );
        }
        eprint_line!(
            "downloading {}/{file} from {} into {}",
            self.repo_id,
            self.endpoint,
            self.cache.path().display()
        );
        let mut retry = 0;
        let path = loop {
            match self.api.download(file) {
                Ok(path) => break path,
                Err(e) if retry < RETRIES && interrupted(&e) => {
                    retry += 1;
                    eprint_line!(
                        "download of {}/{file} interrupted ({e}); resuming, retry {retry} of {RETRIES}",
                        self.repo_id
                    );
                    std::thread::sleep(RETRY_PAUSE * retry as u32);
                }
                Err(e) if retry > 0 && interrupted(&e) => bail!(
                    "{:#}; gave up after {RETRIES} retries, run again to resume the partial download",
                    self.explain(e, Some(file))
                ),
                Err(e) => return Err(self.explain(e, Some(file))),
            }
        };
        self.check_lfs_digest(&path, file)?;
        Ok(path)
    }

    /// An LFS file's blob is named by its sha256: a download that does not
    /// hash to it is removed (hf-hub appends what a resumed request returns
    /// without checking it is the range asked for).
    fn check_lfs_digest(&self, path: &Path, file: &str) -> Result<()> {
        let blob =
            std::fs::canonicalize(path).with_context(|| format!("resolving {}", path.display()))?;
        let Some(etag) = blob.file_name().and_then(|n| n.to_str()) else {
            return Ok(());
        };
        if etag.len() != 64 || !etag.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(());
        }
        let got = sha256_hex(&blob)?;
        if got != etag.to_ascii_lowercase() {
            let _ = std::fs::remove_file(path);
            let _ = std::fs::remove_file(&blob);
            bail!(
                "{}/{file} downloaded with sha256 {got}, but the hub says {etag}; \
                 removed it, run again to download it afresh",
                self.repo_id
            );
        }
        Ok(())
    }

    /// The files of the revision's cached snapshot, as paths in the repo.
    fn cached_files(&self) -> Result<Vec<String>> {
        let repo_dir = self.cache.path().join(self.repo.folder_name());
        let ref_path = repo_dir.join("refs").join(self.repo.revision());
        let commit = std::fs::read_to_string(&ref_path).map_err(|_| {
            anyhow!(
                "{} is not in the hub cache {}",
                self.repo_id,
                self.cache.path().display()
            )
        })?;
        let snapshot = repo_dir.join("snapshots").join(commit.trim());
        let mut files = Vec::new();
        collect_files(&snapshot, "", &mut files)?;
        files.sort();
        Ok(files)
    }

    /// A hub error as a user can act on it; `file` is None for the listing.
    fn explain(&self, error: ApiError, file: Option<&str>) -> anyhow::Error {
        let repo = &self.repo_id;
        let what = match file {
            Some(f) => format!("{repo}/{f}"),
            None => format!("the file list of {repo}"),
        };
        let e = match error {
            ApiError::RequestError(e) => *e,
            ApiError::MissingHeader(header) => {
                return anyhow!(
                    "{} answered {what} without the {header} header; is HF_ENDPOINT a \
                     Hugging Face hub?",
                    self.endpoint
                )
            }
            ApiError::LockAcquisition(lock) => {
                return anyhow!(
                    "another process is downloading {what} (it holds {})",
                    lock.display()
                )
            }
            other => return anyhow!("downloading {what} from {}: {other}", self.endpoint),
        };
        match e {
            ureq::Error::Status(401 | 403, _) if self.has_token => anyhow!(
                "{} refused the token (from {TOKEN_VAR} or {}) for {what}; check that \
                 it may read {repo}",
                self.endpoint,
                self.cache.token_path().display()
            ),
            ureq::Error::Status(code @ (401 | 403), _) => anyhow!(
                "{} refused {what} ({code}): {repo} is gated, private or missing; set \
                 {TOKEN_VAR} to a token that may read it",
                self.endpoint
            ),
            ureq::Error::Status(404, _) if file.is_none() => {
                anyhow!("{} has no model repo {repo} (404)", self.endpoint)
            }
            ureq::Error::Status(404, _) => anyhow!(
                "{} has no {what} at revision {} (404)",
                self.endpoint,
                self.repo.revision()
            ),
            ureq::Error::Status(code, _) => {
                anyhow!("{} answered {code} for {what}", self.endpoint)
            }
            ureq::Error::Transport(t) => anyhow!(
                "cannot reach {} for {what}: {t} (with {HUB_OFFLINE_VAR}=1 only the \
                 cache is used)",
                self.endpoint
            ),
        }
    }
}

/// A connection that failed or broke off: worth resuming.
fn interrupted(error: &ApiError) -> bool {
    match error {
        ApiError::IoError(_) => true,
        ApiError::RequestError(e) => matches!(**e, ureq::Error::Transport(_)),
        _ => false,
    }
}

/// Every file under `dir` (following the cache's symlinks), as `prefix/name`.
fn collect_files(dir: &Path, prefix: &str, files: &mut Vec<String>) -> Result<()> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let relative = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        if path.is_dir() {
            collect_files(&path, &relative, files)?;
        } else if path.is_file() {
            files.push(relative);
        }
    }
    Ok(())
}
