//! `kakeya serve`: the OpenAI-compatible server (`kakeya-server`) on the chosen model.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use kakeya_models::GemmaModel;
use kakeya_runtime::{Costs, DraftKind, KvPolicy, NgramTable, Restorer, SpecConfig};
use kakeya_server::{ApiKeys, ConnectionLimits, EngineParts, HttpConfig, Limits};

use crate::common::{ModelArgs, check_block_size, drafter_dir, load_drafter};
use crate::draft::NGRAM_BLOCK;
use crate::kv::{KvArgs, KvRun};

/// Arguments of `kakeya serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The model's name in `/v1/models` and requests (default: the model file's or folder's
    /// name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// A DFlash drafter folder: a request that runs alone decodes speculatively (lossless).
    /// Default: the trained drafter of the default model, when present.
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// Never decode speculatively.
    #[arg(long)]
    pub no_drafter: bool,
    /// What drafts: dflash, ngram or combined (default: combined with a drafter).
    #[arg(long)]
    pub draft: Option<DraftKind>,
    /// Fixed speculative block size (default: adaptive).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Most sequences decoding at once (their steps share forwards).
    #[arg(long, default_value_t = 16)]
    pub max_seqs: usize,
    /// Most requests waiting for a slot; more are refused with 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Longest prompt, in tokens.
    #[arg(long, default_value_t = 8192)]
    pub max_prompt_tokens: usize,
    /// Largest `max_tokens` a request may ask for (also a chat request's default).
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// `max_tokens` of a completion request that gives none (OpenAI's default: 16).
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Prefill chunk length (as `kakeya infer --prefill-chunk`).
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Do not stop on runaway repetition.
    #[arg(long)]
    pub no_loop_guard: bool,
    /// MiB of finished sequences kept for prompts that start the same way (prefix caching; 0:
    /// off). Used only where it cannot change a token: the `full` KV mode on the CPU's
    /// GGUF kernels.
    #[arg(long, default_value_t = 256)]
    pub prefix_cache_mib: usize,
    /// Whether sampled requests verify their lookups' drafts beside other sequences, as
    /// greedy ones do (`true`/`false`). Default: on a GPU, which draws where the logits are;
    /// not on the CPU, where a sampled row computes every logit.
    #[arg(long, value_name = "BOOL")]
    pub sampled_blocks: Option<bool>,
    /// Beside other sequences, pad every block to one length so that a batched step has at
    /// most this many rows and one shape while its sequences last (0: as many drafts as the
    /// schedule expects to pay, a shape that changes every step). Default: 16 where the
    /// forwards are recorded and replayed (a GPU: one recording then serves every step), else
    /// 0.
    #[arg(long, value_name = "ROWS")]
    pub beside_rows: Option<usize>,
    /// Seconds requests in flight get to finish after SIGTERM or Ctrl-C.
    #[arg(long, default_value_t = 30)]
    pub drain_secs: u64,
    /// An API key requests to `/v1/*` and `/metrics` must carry as `Authorization: Bearer KEY`
    /// (repeat for several; without any key the server is open). Never logged.
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped), beside any
    /// `--api-key`.
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve `/metrics` without a key when keys are set.
    #[arg(long)]
    pub open_metrics: bool,
    /// Serve HTTPS with this PEM certificate chain (with `--ssl-key-file`).
    #[arg(long, value_name = "PEM", requires = "ssl_key_file")]
    pub ssl_cert_file: Option<PathBuf>,
    /// The PEM private key of `--ssl-cert-file`.
    #[arg(long, value_name = "PEM", requires = "ssl_cert_file")]
    pub ssl_key_file: Option<PathBuf>,
    /// Most connections open at once (kept below the process's open-file limit); one more gets
    /// a 503 and is closed.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds a connection gets to send a request's head, from its opening or, kept alive,
    /// from the end of its previous response; then it is closed.
    #[arg(long, default_value_t = 30.0, value_parser = positive_secs)]
    pub header_timeout_secs: f64,
    /// Seconds a request's body gets once its head has arrived; then 408.
    #[arg(long, default_value_t = 30.0, value_parser = positive_secs)]
    pub body_timeout_secs: f64,
    /// Seconds a streamed answer waits for a client that stopped reading; then the sequence
    /// ends and its caches are freed.
    #[arg(long, default_value_t = 60.0, value_parser = positive_secs)]
    pub stall_timeout_secs: f64,
    /// Tests and simulations: `STEP_US,ROW_US,DRAFT_US` — speculation's schedule (alone and
    /// beside other sequences) is told that a forward of `R` rows costs `STEP_US + ROW_US ·
    /// (R − 1)` µs and a draft `DRAFT_US` µs per token, instead of the measured seconds, so
    /// that its choices do not depend on the machine's load.
    #[arg(long, hide = true, value_parser = parse_costs)]
    pub modelled_costs: Option<Costs>,
    #[command(flatten)]
    pub table: crate::ngram::TableArgs,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// A timeout in seconds: positive and finite (fractions allowed).
fn positive_secs(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() && x < 1e9 => Ok(x),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

/// The API keys of `--api-key` and `--api-key-file`.
fn api_keys(a: &ServeArgs) -> Result<ApiKeys> {
    let mut keys = a.api_keys.clone();
    if let Some(f) = &a.api_key_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("--api-key-file {}: cannot read it", f.display()))?;
        let listed = ApiKeys::parse_file(&text);
        if listed.is_empty() {
            bail!(
                "--api-key-file {}: no key in it (one per line)",
                f.display()
            );
        }
        keys.extend(listed);
    }
    if keys
        .iter()
        .any(|k| k.trim().is_empty() || k.chars().any(char::is_whitespace))
    {
        bail!("an API key must be non-empty and hold no spaces");
    }
    Ok(ApiKeys::new(keys))
}

/// What the startup line says the server runs: speculative or plain (and why), how many
/// sequences, the KV mode and the prefix cache.
fn startup_summary(
    a: &ServeArgs,
    model: &GemmaModel,
    speculation: Option<(DraftKind, SpecConfig)>,
    table: Option<&NgramTable>,
    policy: KvPolicy,
) -> String {
    format!(
        "{}; up to {} sequences at once; KV {}; prefix cache {}",
        match speculation {
            Some((k, _)) => format!(
                "speculative with {k} drafts{} when a request runs alone",
                match (table, k) {
                    (Some(t), DraftKind::Ngram | DraftKind::Combined) =>
                        format!(" and an n-gram table of {} contexts", t.len()),
                    _ => String::new(),
                }
            ),
            None => format!(
                "plain decoding: {}",
                crate::common::plain_reason(a.no_drafter, false, &a.model, policy.mode.restores())
            ),
        },
        a.max_seqs,
        policy.mode.name(),
        if a.prefix_cache_mib == 0 {
            "off".to_string()
        } else if kakeya_runtime::PrefixCache::applies(model, &policy) {
            format!("{} MiB", a.prefix_cache_mib)
        } else {
            "off (it would change numbers with this KV mode or device)".to_string()
        }
    )
}

/// The HTTP side's settings: limits, keys, timeouts, connections (capped below the open-file
/// limit) and TLS.
fn http_config(
    a: &ServeArgs,
    model_name: String,
    api_keys: ApiKeys,
    tls: Option<kakeya_server::Tls>,
) -> HttpConfig {
    let file_limit = kakeya_server::connections::open_file_limit();
    let connections = ConnectionLimits {
        max_open: kakeya_server::connections::connection_cap(a.max_connections, file_limit),
        header_timeout: Duration::from_secs_f64(a.header_timeout_secs),
    };
    if connections.max_open < a.max_connections {
        tracing::warn!(
            "at most {} connections: the process may open {} files",
            connections.max_open,
            file_limit.unwrap_or(0)
        );
    }
    HttpConfig {
        model_name,
        limits: Limits {
            max_tokens: a.max_tokens_limit,
            default_completion_tokens: a.default_max_tokens,
            max_prompt_tokens: a.max_prompt_tokens,
        },
        max_queue: a.max_queue,
        max_body_bytes: a.max_body_bytes,
        loop_guard: !a.no_loop_guard,
        api_keys,
        open_metrics: a.open_metrics,
        body_timeout: Duration::from_secs_f64(a.body_timeout_secs),
        stall_timeout: Duration::from_secs_f64(a.stall_timeout_secs),
        connections,
        tls,
    }
}

/// Runs `kakeya serve`.
pub fn run(a: ServeArgs) -> Result<()> {
    kakeya_server::keep_large_buffers_apart();
    if a.max_seqs == 0 {
        bail!("--max-seqs must be at least 1");
    }
    if a.max_tokens_limit == 0 || a.default_max_tokens == 0 {
        bail!("--max-tokens-limit and --default-max-tokens must be at least 1");
    }
    if a.no_drafter && (a.draft.is_some() || a.drafter.is_some()) {
        bail!("--no-drafter decodes plainly; drop --draft and --drafter");
    }
    let path = a.model.model_path()?;
    let (model, tok) = a.model.load()?;
    let wants_drafter = a.draft.is_none_or(DraftKind::needs_drafter);
    let drafter_dir = drafter_dir(
        a.drafter.as_ref(),
        !a.no_drafter && wants_drafter,
        &a.model,
        a.kv.policy()?.mode.restores(),
    );
    let drafter = match &drafter_dir {
        Some(dir) if wants_drafter => Some(load_drafter(dir, &model)?),
        _ => None,
    };
    let kv = KvRun::prepare(
        &a.kv,
        &a.model,
        &model,
        a.drafter.as_deref(),
        drafter.as_ref(),
    )?;
    let speculation = if a.no_drafter || (drafter.is_none() && a.draft.is_none()) {
        if a.block_size.is_some() {
            bail!("--block-size needs speculative decoding (--drafter or --draft)");
        }
        None
    } else {
        let kind = a.draft.unwrap_or(DraftKind::Combined);
        let longest = drafter.as_ref().map_or(NGRAM_BLOCK, |d| d.block_size());
        if let Some(b) = a.block_size {
            check_block_size(b, model.config.max_position_embeddings)?;
        }
        let spec = crate::draft::schedule(a.block_size, longest);
        Some((kind, a.modelled_costs.map_or(spec, |c| spec.with_costs(c))))
    };
    let KvRun {
        policy,
        store_drafter,
        restorer,
    } = kv;
    let drafter = drafter.or(store_drafter);
    let table = match speculation {
        Some((kind, _)) => a.table.load(&a.model, model.config.vocab_size, kind)?,
        None => None,
    };
    let model_name = a.model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    let listener = TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
    let api_keys = api_keys(&a)?;
    let tls = match (&a.ssl_cert_file, &a.ssl_key_file) {
        (Some(cert), Some(key)) => {
            Some(kakeya_server::Tls::from_pem_files(cert, key).map_err(anyhow::Error::msg)?)
        }
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let addr = listener.local_addr()?;
    let what = startup_summary(&a, &model, speculation, table.as_deref(), policy);
    eprintln!("kakeya serve: {model_name} on {scheme}://{addr} ({what})");
    let sampled_blocks = a
        .sampled_blocks
        .unwrap_or_else(|| EngineParts::sampled_blocks_by_default(&model));
    let beside_rows = match a.beside_rows {
        Some(0) => None,
        Some(rows) => Some(rows),
        None => EngineParts::beside_rows_by_default(&model),
    };
    let parts = EngineParts {
        model,
        drafter,
        speculation,
        table,
        policy,
        restorer: restorer.map(|r| Box::new(r) as Box<dyn Restorer>),
        prefill_chunk: a.prefill_chunk,
        max_seqs: a.max_seqs,
        prefix_cache_bytes: a.prefix_cache_mib << 20,
        sampled_blocks,
        beside_rows,
    };
    let cfg = http_config(&a, model_name, api_keys, tls);
    kakeya_server::serve(parts, tok, cfg, listener, Duration::from_secs(a.drain_secs))?;
    eprintln!("kakeya serve: stopped");
    Ok(())
}

/// `STEP_US,ROW_US,DRAFT_US` → [`Costs::Linear`].
fn parse_costs(s: &str) -> std::result::Result<Costs, String> {
    let v: Vec<u32> = s
        .split(',')
        .map(|x| x.trim().parse::<u32>().map_err(|e| format!("{x:?}: {e}")))
        .collect::<std::result::Result<_, _>>()?;
    match v[..] {
        [step_us, row_us, draft_us] => Ok(Costs::Linear {
            step_us,
            row_us,
            draft_us,
        }),
        _ => Err(format!("expected STEP_US,ROW_US,DRAFT_US, got {s:?}")),
    }
}
