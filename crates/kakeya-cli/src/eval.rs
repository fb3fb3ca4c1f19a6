//! `kakeya eval niah`: needle-in-a-haystack recall of every KV mode against `full`, with the
//! bytes each mode holds; per-item results are appended as they finish, so a killed run
//! continues with `--resume`.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kakeya_capture::job::sha256_path;
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    DFlashProposer, FThetaRestorer, Generation, GenerationConfig, KvMode, KvPolicy, KvSetup,
    Sampling, Session, SpecConfig, Verifier, generate, speculative_generate,
};
use kakeya_weights::Tokenizer;
use serde::{Deserialize, Serialize};

use crate::common::{ModelArgs, default_drafter, load_drafter};
use crate::eval_prompts::{Item, ladder, read_prompts};
use crate::eval_report::{ItemResult, SCHEMA_VERSION, report};
use crate::kv::{f_theta_dir, load_f_theta};
use kakeya_train::state::write_file_atomically as write_atomically;

/// `kakeya eval ...`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub what: EvalWhat,
}

/// Evaluations.
#[derive(Subcommand, Debug)]
pub enum EvalWhat {
    /// Needle-in-a-haystack recall and KV bytes per KV mode.
    Niah(NiahArgs),
    /// Tokens per verify of draft trees against chains at each row budget, on the model's
    /// own greedy outputs.
    Trees(crate::eval_trees::TreesArgs),
}

/// Arguments of `kakeya eval niah`.
#[derive(Args, Debug)]
pub struct NiahArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// KV modes, comma-separated, or `all` (`full` is always run: it is the reference).
    #[arg(long, default_value = "all")]
    pub modes: String,
    /// First positions bounded layers keep exactly.
    #[arg(long, default_value_t = 4)]
    pub kv_sink: usize,
    /// Most recent positions bounded layers keep exactly.
    #[arg(long, default_value_t = 64)]
    pub kv_window: usize,
    /// Drafter folder (the compact store of the restored modes; speculation with
    /// --speculative). Default: the trained drafter of the default model.
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// f_θ folder for the restored modes (default: the default model's).
    #[arg(long)]
    pub f_theta: Option<PathBuf>,
    /// Prompt lengths of the generated ladder, in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [512, 1024, 2048, 3584])]
    pub lengths: Vec<usize>,
    /// Needle depths (0 = first line of the haystack, 1 = last).
    #[arg(long, value_delimiter = ',', default_values_t = [0.1, 0.3, 0.5, 0.7, 0.9])]
    pub depths: Vec<f64>,
    /// Prompts per (length, depth).
    #[arg(long, default_value_t = 2)]
    pub per_cell: usize,
    /// Distractor keys (other codes) per prompt.
    #[arg(long, default_value_t = 3)]
    pub distractors: usize,
    /// Also, per (length, depth), --per-cell prompts with this many needles (spread over the
    /// haystack from the depth on), all asked for; an answer counts when it holds every code.
    /// 0: single needles only.
    #[arg(long, default_value_t = 0)]
    pub multi_key: usize,
    /// Seed of the generator.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Use these prompts instead: JSON lines `{"id", "text", "answer"}` (other fields are
    /// ignored); each is reported under the --lengths value nearest its token count.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Most tokens generated per answer.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Prefill chunk length (a chunk's positions read each other exactly).
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Decode speculatively with the drafter (same output; other tok/s).
    #[arg(long)]
    pub speculative: bool,
    /// Speculative block size (default: the drafter's).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Output folder: settings.json, items.jsonl (per-item results), report.json, recall.png.
    #[arg(long, default_value = "runs/eval-niah")]
    pub out: PathBuf,
    /// Continue an interrupted evaluation in --out (refused when the settings differ).
    #[arg(long)]
    pub resume: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// What a resumed run must share with the run it continues.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Report schema.
    pub schema_version: u32,
    /// SHA-256 of the model.
    pub model_sha256: String,
    /// The modes, `full` first.
    pub modes: Vec<KvMode>,
    /// Sink and window of the bounded modes.
    pub sink: usize,
    /// See [`NiahArgs::kv_window`].
    pub window: usize,
    /// SHA-256 of the drafter folder (when used).
    pub drafter_sha256: Option<String>,
    /// SHA-256 of the f_θ folder (when used).
    pub f_theta_sha256: Option<String>,
    /// Generator settings, or the prompts file's hash.
    pub prompts: String,
    /// See [`NiahArgs::max_tokens`].
    pub max_tokens: usize,
    /// See [`NiahArgs::prefill_chunk`].
    pub prefill_chunk: usize,
    /// Speculative block size (`None`: plain decoding).
    pub block: Option<usize>,
}

/// Parses `--modes`: `all` or a comma list; `full` first, no repeats.
pub fn parse_modes(s: &str) -> Result<Vec<KvMode>> {
    let mut out = vec![KvMode::Full];
    if s.trim() == "all" {
        out.extend(KvMode::all().into_iter().skip(1));
        return Ok(out);
    }
    for m in s.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        let mode: KvMode = m.parse()?;
        if !out.contains(&mode) {
            out.push(mode);
        }
    }
    Ok(out)
}

/// Everything one mode's run needs.
struct Engine<'m> {
    model: &'m GemmaModel,
    drafter: Option<&'m DFlashDrafter>,
    restorer: Option<&'m FThetaRestorer>,
    block: Option<usize>,
    cfg: GenerationConfig,
}

impl Engine<'_> {
    /// One prompt under `policy`, at most `max_tokens` generated.
    fn run(&self, policy: KvPolicy, ids: &[u32], max_tokens: usize) -> Result<Generation> {
        let cfg = GenerationConfig {
            max_tokens,
            ..self.cfg.clone()
        };
        let mut setup = KvSetup::new(policy);
        if policy.mode.restores() || self.block.is_some() {
            setup = setup.drafter(self.drafter.expect("loaded when needed"));
        }
        if let Some(r) = self.restorer {
            setup = setup.restorer(r);
        }
        Ok(match (self.block, self.drafter) {
            (Some(block), Some(d)) => {
                let mut v = Verifier::new(self.model, setup, block)?;
                speculative_generate(
                    &mut v,
                    &mut DFlashProposer::new(d),
                    ids,
                    &cfg,
                    SpecConfig::fixed(block),
                    &mut |_| {},
                )?
            }
            _ => generate(
                &mut Session::with_kv(self.model, setup)?,
                ids,
                &cfg,
                &mut |_| {},
            )?,
        })
    }
}

/// Reads the per-item results of an interrupted run (a torn last line is dropped).
fn read_results(path: &Path) -> Result<Vec<ItemResult>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let body =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let lines: Vec<&str> = body.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        match serde_json::from_str(l) {
            Ok(r) => out.push(r),
            Err(_) if i + 1 == lines.len() => break,
            Err(e) => bail!("{}:{}: not a result: {e}", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// `--modes`' policy for `mode`, with the sink and window of the arguments.
fn policy(a: &NiahArgs, mode: KvMode) -> KvPolicy {
    KvPolicy {
        mode,
        sink: a.kv_sink,
        window: a.kv_window,
        ..KvPolicy::new(mode)
    }
}

/// The model and what the modes need beside it, loaded and checked.
struct Loaded {
    model_path: PathBuf,
    model: GemmaModel,
    tok: Tokenizer,
    drafter_dir: PathBuf,
    drafter: Option<DFlashDrafter>,
    f_dir: Option<PathBuf>,
    restorer: Option<FThetaRestorer>,
    /// Speculative block size (`None`: plain decoding).
    block: Option<usize>,
}

/// Loads the model, and the drafter and f_θ where a mode or `--speculative` needs them;
/// checks every mode's policy against the model's context and the block.
fn load(a: &NiahArgs, modes: &[KvMode]) -> Result<Loaded> {
    let model_path = a.model.model_path()?;
    let (model, tok) = a.model.load()?;
    let ctx = model.config.max_position_embeddings;
    for &mode in modes {
        policy(a, mode).check(ctx, 1)?;
    }
    let restores = modes.iter().any(|m| m.restores());
    let drafter_dir = a
        .drafter
        .clone()
        .unwrap_or_else(|| PathBuf::from(default_drafter(restores)));
    let drafter = if a.speculative || restores {
        Some(load_drafter(&drafter_dir, &model)?)
    } else {
        None
    };
    let f_dir = if restores {
        Some(f_theta_dir(
            a.f_theta.as_ref(),
            a.model.uses_default_model() && a.drafter.is_none(),
        )?)
    } else {
        None
    };
    let restorer = match (&f_dir, &drafter) {
        (Some(dir), Some(d)) => Some(load_f_theta(dir, &model_path, &drafter_dir, &model, d)?),
        _ => None,
    };
    let block = match (&drafter, a.speculative) {
        (Some(d), true) => Some(a.block_size.unwrap_or(d.block_size())),
        _ if a.block_size.is_some() => bail!("--block-size needs --speculative"),
        _ => None,
    };
    if let Some(b) = block {
        for &mode in modes {
            policy(a, mode).check(ctx, b)?;
        }
    }
    Ok(Loaded {
        model_path,
        model,
        tok,
        drafter_dir,
        drafter,
        f_dir,
        restorer,
        block,
    })
}

/// The settings a resumed run must match.
fn settings(a: &NiahArgs, modes: &[KvMode], l: &Loaded) -> Result<Settings> {
    Ok(Settings {
        schema_version: SCHEMA_VERSION,
        model_sha256: sha256_path(&l.model_path)?,
        modes: modes.to_vec(),
        sink: a.kv_sink,
        window: a.kv_window,
        drafter_sha256: l
            .drafter
            .as_ref()
            .map(|_| sha256_path(&l.drafter_dir))
            .transpose()?,
        f_theta_sha256: l.f_dir.as_deref().map(sha256_path).transpose()?,
        prompts: match &a.prompts {
            Some(p) => format!("file sha256 {}", sha256_path(p)?),
            None => format!(
                "ladder seed {} lengths {:?} depths {:?} per_cell {} distractors {} multi_key {}",
                a.seed, a.lengths, a.depths, a.per_cell, a.distractors, a.multi_key
            ),
        },
        max_tokens: a.max_tokens,
        prefill_chunk: a.prefill_chunk,
        block: l.block,
    })
}

/// The results so far (those of the run `--resume` continues, whose settings must be the
/// same; none otherwise) and the results file opened for appending, rewritten without a torn
/// last line.
fn open_results(a: &NiahArgs, settings: &Settings) -> Result<(Vec<ItemResult>, std::fs::File)> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let settings_path = a.out.join("settings.json");
    let results_path = a.out.join("items.jsonl");
    let results = if a.resume {
        let text = std::fs::read_to_string(&settings_path).with_context(|| {
            format!(
                "--resume: {} has no evaluation to continue",
                a.out.display()
            )
        })?;
        let before: Settings = serde_json::from_str(&text).with_context(|| {
            format!("{}: not an evaluation's settings", settings_path.display())
        })?;
        if &before != settings {
            bail!(
                "--resume: {} was made with other settings (model, modes, window, drafter, f_θ, prompts, max tokens, chunk or block); rerun without --resume or with the same settings\n  before: {}\n  now:    {}",
                settings_path.display(),
                serde_json::to_string(&before)?,
                serde_json::to_string(settings)?
            );
        }
        read_results(&results_path)?
    } else {
        if results_path.exists() {
            bail!(
                "{} holds results of an earlier evaluation: pass --resume to continue it, or another --out",
                a.out.display()
            );
        }
        write_atomically(
            &settings_path,
            serde_json::to_string_pretty(settings)?.as_bytes(),
        )?;
        Vec::new()
    };
    let mut body = String::new();
    for r in &results {
        body.push_str(&serde_json::to_string(r)?);
        body.push('\n');
    }
    write_atomically(&results_path, body.as_bytes())?;
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(&results_path)
        .with_context(|| format!("opening {}", results_path.display()))?;
    Ok((results, file))
}

/// One item in one mode: generates, and scores the output against the item's codes and
/// against `full`'s tokens for the item (when `full` has run it).
fn run_item(
    engine: &Engine<'_>,
    tok: &Tokenizer,
    (item, ids): (&Item, &[u32]),
    policy: KvPolicy,
    max_tokens: usize,
    full: Option<&Vec<u32>>,
) -> Result<ItemResult> {
    let mode = policy.mode;
    let g = engine
        .run(policy, ids, max_tokens)
        .with_context(|| format!("prompt {} in mode {mode}", item.id))?;
    let output = tok.decode(&g.tokens)?;
    let first_divergence = full.and_then(|f| {
        let same = f.iter().zip(&g.tokens).take_while(|(x, y)| x == y).count();
        (same < f.len().max(g.tokens.len())).then_some(same)
    });
    Ok(ItemResult {
        id: item.id.clone(),
        mode,
        bucket: item.bucket,
        depth: item.depth,
        prompt_tokens: ids.len(),
        correct: output.contains(&item.answer)
            && item.also.iter().all(|c| output.contains(c.as_str())),
        answer: item.answer.clone(),
        also: item.also.clone(),
        output,
        first_divergence_from_full: first_divergence,
        kv_bytes: g.stats.kv.total,
        kv: g.stats.kv.clone(),
        prefill_tok_s: g.stats.prefill_tok_s,
        decode_tok_s: g.stats.decode_tok_s,
        tokens: g.tokens,
    })
}

/// Runs `kakeya eval niah`.
pub fn run(a: NiahArgs) -> Result<()> {
    let modes = parse_modes(&a.modes)?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let l = load(&a, &modes)?;
    let (tok, ctx) = (&l.tok, l.model.config.max_position_embeddings);
    let items = match &a.prompts {
        Some(p) => read_prompts(p, &a.lengths, tok)?,
        None => ladder(&a, tok)?,
    };
    let settings = settings(&a, &modes, &l)?;
    let (mut results, mut file) = open_results(&a, &settings)?;
    let results_path = a.out.join("items.jsonl");
    let done: HashSet<(String, KvMode)> = results.iter().map(|r| (r.id.clone(), r.mode)).collect();
    let mut full_tokens: HashMap<String, Vec<u32>> = results
        .iter()
        .filter(|r| r.mode == KvMode::Full)
        .map(|r| (r.id.clone(), r.tokens.clone()))
        .collect();
    let engine = Engine {
        model: &l.model,
        drafter: l.drafter.as_ref(),
        restorer: l.restorer.as_ref(),
        block: l.block,
        cfg: GenerationConfig {
            max_tokens: a.max_tokens,
            sampling: Sampling::Greedy,
            stop_tokens: [Some(tok.eos), tok.end_of_turn]
                .into_iter()
                .flatten()
                .collect(),
            prefill_chunk: a.prefill_chunk,
            loop_guard: None,
        },
    };
    let bar = indicatif::ProgressBar::new((items.len() * modes.len()) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("niah [{bar:30}] {pos}/{len} {msg} ({eta})")
            .expect("static template"),
    );
    bar.set_position(done.len() as u64);
    for item in &items {
        let mut ids = vec![tok.bos];
        ids.extend(tok.encode(&item.text)?);
        // A multi-key answer lists every code: room for each.
        let max_tokens = a.max_tokens * (1 + item.also.len());
        if ids.len() + max_tokens > ctx {
            bail!(
                "prompt {} has {} tokens: with {max_tokens} to generate, more than the model's context of {ctx}",
                item.id,
                ids.len()
            );
        }
        for &mode in &modes {
            if done.contains(&(item.id.clone(), mode)) {
                continue;
            }
            bar.set_message(format!("{} {mode}", item.id));
            let full = full_tokens.get(&item.id);
            let r = run_item(
                &engine,
                tok,
                (item, &ids),
                policy(&a, mode),
                max_tokens,
                full,
            )?;
            if mode == KvMode::Full {
                full_tokens.insert(item.id.clone(), r.tokens.clone());
            }
            let mut line = serde_json::to_string(&r)?;
            line.push('\n');
            file.write_all(line.as_bytes())
                .and_then(|()| file.sync_data())
                .with_context(|| format!("appending to {}", results_path.display()))?;
            results.push(r);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    write_report(&a, &settings, &results)
}

/// Writes report.json and recall.png to `--out` and prints the table (or the JSON).
fn write_report(a: &NiahArgs, settings: &Settings, results: &[ItemResult]) -> Result<()> {
    let rep = report(settings, results);
    write_atomically(
        &a.out.join("report.json"),
        serde_json::to_string_pretty(&rep)?.as_bytes(),
    )?;
    write_atomically(&a.out.join("recall.png"), &crate::eval_report::plot(&rep))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
    } else {
        crate::eval_report::print_table(&rep);
        eprintln!(
            "report: {}, plot: {}",
            a.out.join("report.json").display(),
            a.out.join("recall.png").display()
        );
    }
    Ok(())
}
