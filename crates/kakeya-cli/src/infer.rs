//! `kakeya infer`: generation with streaming output, chat, and stats.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::chat::{self, ChatSession, Message};
use kakeya_runtime::{
    Generation, GenerationConfig, KvMode, KvSetup, RunawayGuard, Session, SpecConfig, TextStream,
    Verifier, generate, speculative_generate,
};
use kakeya_weights::Tokenizer;

use crate::common::{ModelArgs, SamplingArgs, check_block_size, drafter_dir, load_drafter};
use crate::draft::{DraftKind, NGRAM_BLOCK};
use crate::kv::{KvArgs, KvRun};

/// Arguments of `kakeya infer`.
#[derive(Args, Debug)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "chat", "chat_file"])))]
pub struct InferArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (raw completion; no chat template).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Interactive multi-turn chat on stdin with Gemma's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A JSON file `[{"role": "user", "content": "..."}, ...]`: answer its last turn.
    #[arg(long)]
    pub chat_file: Option<PathBuf>,
    /// Most tokens to generate (per turn in chat).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Print one JSON object (text, token ids, stats) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Prefill chunk length.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// A DFlash drafter folder (z-lab format): decode speculatively (lossless: greedy output is
    /// token-identical, sampled output has the same distribution). Without it, the default
    /// model uses the trained drafter in `checkpoints/` when present (non-interactive runs).
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// Decode autoregressively even when a drafter is given or the default one exists (the
    /// restored KV modes still fill their compact store with it).
    #[arg(long)]
    pub no_drafter: bool,
    /// What drafts: `dflash` (the drafter), `ngram` (prompt lookup, no drafter needed) or
    /// `combined` (lookup when the context backs it, the drafter otherwise). Default: `combined`
    /// when a drafter is given or the default one is used, otherwise plain decoding.
    #[arg(long)]
    pub draft: Option<DraftKind>,
    /// Tokens per speculative block, fixed. Without it blocks adapt, up to the drafter's
    /// `block_size` (8 for `ngram`), down to plain decoding when speculation loses.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Also decode the same prompt autoregressively and report its tok/s (and whether the
    /// tokens are identical) in the stats.
    #[arg(long)]
    pub compare_ar: bool,
    /// Do not stop on runaway repetition (a 1–8 token unit repeated 12 times).
    #[arg(long)]
    pub no_loop_guard: bool,
    #[command(flatten)]
    pub table: crate::ngram::TableArgs,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// Prints text as tokens arrive (holding back incomplete UTF-8) to stdout.
struct Printer<'t>(TextStream<'t>);

impl Printer<'_> {
    fn print(piece: Result<Option<String>, kakeya_runtime::RuntimeError>) {
        match piece {
            Ok(Some(text)) => {
                print!("{text}");
                let _ = std::io::stdout().flush();
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("cannot decode streamed tokens: {e}"),
        }
    }

    fn push(&mut self, id: u32) {
        Self::print(self.0.push(id));
    }

    fn finish(&mut self) {
        Self::print(self.0.finish());
    }
}

/// The stats lines on stderr; `plain`: why the run decodes without speculation, when it does.
fn print_stats(g: &Generation, plain: Option<&str>) {
    let s = &g.stats;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "\n[prompt {} tok, prefill {:.1} tok/s | generated {} tok, decode {:.1} tok/s | stop: {:?}]",
        s.prompt_tokens, s.prefill_tok_s, s.generated_tokens, s.decode_tok_s, g.stop_reason
    );
    let kv = &s.kv;
    eprintln!(
        "[KV {}: {:.2} MiB held (exact {:.2}, quantised {:.2}, store {:.2}, transient peak {:.2}); full cache in 16-bit would be {:.2} MiB: {:.2}x]",
        s.kv_mode.map_or_else(|| "full".to_string(), |m| m.name()),
        mib(kv.total),
        mib(kv.exact),
        mib(kv.quantised),
        mib(kv.store),
        mib(kv.transient_peak),
        mib(kv.full_f16),
        kv.ratio_to_full_f16
    );
    if let Some(sp) = &g.spec {
        eprintln!(
            "[speculative ({:?} blocks up to {}): {} blocks ({} plain steps), mean acceptance length {:.2}]",
            sp.schedule.unwrap_or(kakeya_runtime::Schedule::Fixed),
            sp.block_size,
            sp.blocks,
            sp.schedule_stats
                .blocks_by_length
                .first()
                .copied()
                .unwrap_or(0),
            sp.mean_acceptance_length
        );
    } else if let Some(why) = plain {
        eprintln!("[plain decoding: {why}]");
    }
}

/// How a run drafts: the proposer kind, its drafter (when it uses one), the static n-gram
/// table of its lookups and the schedule.
#[derive(Clone)]
struct Spec<'d> {
    kind: DraftKind,
    drafter: Option<&'d DFlashDrafter>,
    table: Option<std::sync::Arc<kakeya_runtime::NgramTable>>,
    config: SpecConfig,
}

/// Decodes `ids` under `setup`, speculatively when `spec` is given.
fn decode(
    model: &GemmaModel,
    setup: KvSetup<'_>,
    spec: Option<Spec<'_>>,
    ids: &[u32],
    cfg: &GenerationConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    Ok(match spec {
        Some(s) => {
            let setup = match s.drafter {
                Some(d) => setup.drafter(d),
                None => setup,
            };
            let mut verifier = Verifier::new(model, setup, s.config.block_size)?;
            let mut proposer = s.kind.proposer(s.drafter, s.table)?;
            speculative_generate(
                &mut verifier,
                proposer.as_mut(),
                ids,
                cfg,
                s.config,
                on_token,
            )?
        }
        None => generate(&mut Session::with_kv(model, setup)?, ids, cfg, on_token)?,
    })
}

/// How `kakeya infer` speculates, if it does: the proposer, the drafter and table it drafts
/// from, and the block schedule.
fn speculation<'d>(
    a: &InferArgs,
    speculative: bool,
    model: &GemmaModel,
    drafter: Option<&'d DFlashDrafter>,
) -> Result<Option<Spec<'d>>> {
    Ok(if speculative {
        let kind = a.draft.unwrap_or(DraftKind::Combined);
        let longest = drafter.map_or(NGRAM_BLOCK, |d| d.block_size());
        if let Some(b) = a.block_size {
            check_block_size(b, model.config.max_position_embeddings)?;
        }
        Some(Spec {
            kind,
            drafter,
            table: a.table.load(&a.model, model.config.vocab_size, kind)?,
            config: crate::draft::schedule(a.block_size, longest),
        })
    } else {
        if a.block_size.is_some() {
            bail!("--block-size needs speculative decoding (--drafter or --draft)");
        }
        None
    })
}

/// Runs `kakeya infer`.
pub fn run(a: InferArgs) -> Result<()> {
    let sampling = a.sampling.sampling()?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let (model, tok) = a.model.load()?;
    if a.no_drafter && a.draft.is_some() {
        bail!("--no-drafter decodes plainly; drop --draft");
    }
    let wants_drafter = a.draft.is_none_or(DraftKind::needs_drafter);
    // The default model decodes speculatively with its trained drafter when the run allows it.
    let drafter_dir = drafter_dir(
        a.drafter.as_ref(),
        !a.no_drafter && wants_drafter && !a.chat,
        &a.model,
        a.kv.policy()?.mode.restores(),
    );
    let speculative = !a.no_drafter && (drafter_dir.is_some() || a.draft.is_some());
    let plain = (!speculative).then(|| {
        crate::common::plain_reason(
            a.no_drafter,
            a.chat,
            &a.model,
            a.kv.policy().is_ok_and(|p| p.mode.restores()),
        )
    });
    if speculative && a.chat {
        bail!("--chat with --drafter is not supported yet; use --chat-file for one turn");
    }
    let drafter = match &drafter_dir {
        Some(dir) if speculative && wants_drafter => Some(load_drafter(dir, &model)?),
        _ => None,
    };
    let kv = KvRun::prepare(
        &a.kv,
        &a.model,
        &model,
        a.drafter.as_deref(),
        drafter.as_ref(),
    )?;
    let policy = kv.policy;
    if a.chat && policy.mode != KvMode::Full {
        bail!(
            "--chat keeps the full cache for now; --kv-mode works with --prompt, --prompt-file and --chat-file"
        );
    }
    let setup = kv.setup();
    let spec = speculation(&a, speculative, &model, drafter.as_ref())?;
    let cfg = GenerationConfig {
        max_tokens: a.max_tokens,
        sampling,
        stop_tokens: [Some(tok.eos), tok.end_of_turn]
            .into_iter()
            .flatten()
            .collect(),
        prefill_chunk: a.prefill_chunk,
        loop_guard: (!a.no_loop_guard).then(RunawayGuard::default),
    };
    if a.chat || a.chat_file.is_some() {
        chat::check_template(&model.config)?;
    }
    if a.chat {
        let mut chat = ChatSession::new(&model, &RunawayGuard::default());
        return chat_loop(&mut chat, &tok, &cfg);
    }
    let text = prompt_text(&a)?;
    if text.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let mut ids = vec![tok.bos];
    ids.extend(tok.encode(&text)?);
    let mut printer = Printer(TextStream::new(&tok));
    let draft_name = spec.as_ref().map(|s| s.kind.name());
    let table_bytes = spec
        .as_ref()
        .and_then(|s| s.table.as_ref())
        .map(|t| t.nbytes());
    let g = if a.json {
        decode(&model, setup, spec, &ids, &cfg, &mut |_| {})?
    } else {
        let g = decode(&model, setup, spec, &ids, &cfg, &mut |t| printer.push(t))?;
        printer.finish();
        g
    };
    let ar = if a.compare_ar {
        let ar_setup = match (&kv.store_drafter, &drafter) {
            (None, Some(d)) if policy.mode.restores() => setup.drafter(d),
            _ => setup,
        };
        Some(decode(&model, ar_setup, None, &ids, &cfg, &mut |_| {})?)
    } else {
        None
    };
    if a.json {
        let weights = serde_json::json!({
            "drafter": drafter.as_ref().or(kv.store_drafter.as_ref()).map(|d| d.nbytes()),
            "f_theta": kv.restorer.as_ref().map(kakeya_runtime::Restorer::nbytes),
            "ngram_table": table_bytes,
        });
        let extra = JsonExtra {
            policy,
            weights,
            draft_name,
            plain: plain.as_deref(),
            ar: ar.as_ref(),
        };
        print_json(&tok, &ids, &g, extra)?;
    } else {
        println!();
        print_stats(&g, plain.as_deref());
        if let Some(ar) = &ar {
            eprintln!(
                "[AR on the same prompt: decode {:.1} tok/s; identical tokens: {}]",
                ar.stats.decode_tok_s,
                ar.tokens == g.tokens
            );
        }
    }
    Ok(())
}

/// The prompt of `--prompt`, `--prompt-file` or `--chat-file` (formatted with the chat
/// template).
fn prompt_text(a: &InferArgs) -> Result<String> {
    if let Some(p) = &a.prompt {
        return Ok(p.clone());
    }
    if let Some(f) = &a.prompt_file {
        return std::fs::read_to_string(f)
            .with_context(|| format!("reading prompt file {}", f.display()));
    }
    let f = a.chat_file.as_ref().expect("clap requires one input");
    let body =
        std::fs::read_to_string(f).with_context(|| format!("reading chat file {}", f.display()))?;
    let msgs: Vec<Message> = serde_json::from_str(&body)
        .with_context(|| format!("{}: expected a JSON list of {{role, content}}", f.display()))?;
    chat::format_chat(&msgs).with_context(|| format!("{}", f.display()))
}

/// What `--json` reports beside the generation's own stats.
struct JsonExtra<'a> {
    policy: kakeya_runtime::KvPolicy,
    /// Bytes of the drafter, f_θ and n-gram table held.
    weights: serde_json::Value,
    draft_name: Option<&'a str>,
    /// Why decoding was plain, when it was.
    plain: Option<&'a str>,
    /// The `--compare-ar` run.
    ar: Option<&'a Generation>,
}

/// Prints `--json`'s document: the text, ids, tokens, stop reason and stats.
fn print_json(tok: &Tokenizer, ids: &[u32], g: &Generation, x: JsonExtra<'_>) -> Result<()> {
    let mut stats = serde_json::to_value(&g.stats)?;
    stats["kv_policy"] = serde_json::to_value(x.policy)?;
    stats["weights_bytes"] = x.weights;
    if let Some(sp) = &g.spec {
        stats["speculative"] = serde_json::to_value(sp)?;
        stats["speculative"]["draft"] = x.draft_name.into();
    }
    if let Some(why) = x.plain {
        stats["plain_decoding"] = why.into();
    }
    if let Some(ar) = x.ar {
        stats["ar_decode_tok_s"] = ar.stats.decode_tok_s.into();
        stats["identical_to_ar"] = (ar.tokens == g.tokens).into();
        if g.stats.decode_tok_s > 0.0 && ar.stats.decode_tok_s > 0.0 {
            stats["speedup_vs_ar"] = (g.stats.decode_tok_s / ar.stats.decode_tok_s).into();
        }
    }
    let out = serde_json::json!({
        "text": tok.decode(&g.tokens)?,
        "prompt_ids": ids,
        "tokens": g.tokens,
        "stop_reason": g.stop_reason,
        "stopped_on_runaway": g.stopped_on_runaway,
        "stats": stats,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Interactive chat: each user line is a turn; the caches carry over between turns.
fn chat_loop(chat: &mut ChatSession<'_>, tok: &Tokenizer, cfg: &GenerationConfig) -> Result<()> {
    let stdin = std::io::stdin();
    eprintln!("chat: type a message and press Enter (Ctrl-D to quit)");
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            return Ok(());
        }
        if line.trim().is_empty() {
            continue;
        }
        let mut printer = Printer(TextStream::new(tok));
        let g = chat.reply(tok, &line, cfg, &mut |t| printer.push(t))?;
        printer.finish();
        println!();
        print_stats(&g, Some("--chat decodes without a drafter"));
    }
}
