//! Prometheus metrics (`GET /metrics`, text format 0.0.4): requests by endpoint and status,
//! tokens in and out, time to first token and inter-token latency, tokens committed per
//! verifier forward, rows per batched forward, prompt chunks per forward, K/V bytes held,
//! queue depth, running and cancelled sequences, open and refused connections.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use kakeya_models::gemma::ReplayStats;
use kakeya_runtime::PrefixStats;

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

const LATENCY: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const COMMITTED: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 12.0, 16.0];

#[derive(Debug)]
struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    prompt_tokens: u64,
    generated_tokens: u64,
    cancelled: u64,
    finished: u64,
    ttft: Histogram,
    itl: Histogram,
    committed_per_forward: Histogram,
    batch_rows: Histogram,
    prompt_chunks: Histogram,
    drafts_in_batch: u64,
    drafts_in_batch_accepted: u64,
    kv_bytes: usize,
    queue_depth: usize,
    running: usize,
    prefix: PrefixStats,
    prefix_entries: usize,
    prefix_bytes: usize,
    replays: ReplayStats,
    connections_open: usize,
    connections_refused: u64,
}

/// The server's counters, shared by the HTTP handlers and the engine.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                prompt_tokens: 0,
                generated_tokens: 0,
                cancelled: 0,
                finished: 0,
                ttft: Histogram::new(LATENCY),
                itl: Histogram::new(LATENCY),
                committed_per_forward: Histogram::new(COMMITTED),
                batch_rows: Histogram::new(COMMITTED),
                prompt_chunks: Histogram::new(COMMITTED),
                drafts_in_batch: 0,
                drafts_in_batch_accepted: 0,
                kv_bytes: 0,
                queue_depth: 0,
                running: 0,
                prefix: PrefixStats::default(),
                prefix_entries: 0,
                prefix_bytes: 0,
                replays: ReplayStats::default(),
                connections_open: 0,
                connections_refused: 0,
            }),
        }
    }
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut g)
    }

    /// A request to `endpoint` answered with `status`.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.with(|m| {
            *m.requests
                .entry((endpoint.to_string(), status))
                .or_default() += 1
        });
    }

    /// A sequence admitted with `prompt` tokens.
    pub fn admitted(&self, prompt: usize) {
        self.with(|m| m.prompt_tokens += prompt as u64);
    }

    /// `n` tokens sent to a client, `secs` after the previous ones (or after arrival, for
    /// the first: time to first token).
    pub fn tokens(&self, n: usize, secs: f64, first: bool) {
        self.with(|m| {
            m.generated_tokens += n as u64;
            if first {
                m.ttft.observe(secs);
            } else if n > 0 {
                // Tokens that arrive together share the interval.
                for _ in 0..n {
                    m.itl.observe(secs / n as f64);
                }
            }
        });
    }

    /// A verifier forward that committed `n` tokens of one sequence (a speculative block, or
    /// a plain step: 1).
    pub fn committed(&self, n: usize) {
        self.with(|m| m.committed_per_forward.observe(n as f64));
    }

    /// A batched decode forward over `rows` sequences.
    pub fn batch(&self, rows: usize) {
        self.with(|m| m.batch_rows.observe(rows as f64));
    }

    /// A block verified beside other sequences in a batched decode forward: `drafted` draft
    /// rows, `accepted` of them accepted.
    pub fn drafts_in_batch(&self, drafted: usize, accepted: usize) {
        self.with(|m| {
            m.drafts_in_batch += drafted as u64;
            m.drafts_in_batch_accepted += accepted as u64;
        });
    }

    /// A forward that ran the next prompt chunks of `n` sequences.
    pub fn prompt_chunks(&self, n: usize) {
        self.with(|m| m.prompt_chunks.observe(n as f64));
    }

    /// A sequence ended: finished, or `cancelled` (client gone, or the server shutting down).
    pub fn ended(&self, cancelled: bool) {
        self.with(|m| {
            if cancelled {
                m.cancelled += 1;
            } else {
                m.finished += 1;
            }
        });
    }

    /// Connections open now.
    pub fn connections_open(&self, n: usize) {
        self.with(|m| m.connections_open = n);
    }

    /// A connection past the cap was answered 503 and closed.
    pub fn connection_refused(&self) {
        self.with(|m| m.connections_refused += 1);
    }

    /// The engine's current state.
    pub fn state(&self, running: usize, queue_depth: usize, kv_bytes: usize) {
        self.with(|m| {
            m.running = running;
            m.queue_depth = queue_depth;
            m.kv_bytes = kv_bytes;
        });
    }

    /// The prefix cache's figures: its counters so far, entries and bytes held now.
    pub fn prefix_cache(&self, stats: PrefixStats, entries: usize, bytes: usize) {
        self.with(|m| {
            m.prefix = stats;
            m.prefix_entries = entries;
            m.prefix_bytes = bytes;
        });
    }

    /// How the model's greedy forwards ran on a GPU so far (recorded, replayed, declined).
    pub fn replays(&self, stats: ReplayStats) {
        self.with(|m| m.replays = stats);
    }

    /// Sequences running now (tests and the health check).
    pub fn running(&self) -> usize {
        self.with(|m| m.running)
    }

    /// The Prometheus text.
    pub fn render(&self) -> String {
        self.with(|m| {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "# HELP kakeya_requests_total HTTP requests by endpoint and status.\n# TYPE kakeya_requests_total counter"
            );
            for ((endpoint, status), n) in &m.requests {
                let _ = writeln!(
                    out,
                    "kakeya_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
                );
            }
            let counters = [
                ("kakeya_prompt_tokens_total", "Prompt tokens admitted.", m.prompt_tokens),
                ("kakeya_generated_tokens_total", "Tokens sent to clients.", m.generated_tokens),
                ("kakeya_sequences_finished_total", "Sequences that ran to a stop rule.", m.finished),
                (
                    "kakeya_sequences_cancelled_total",
                    "Sequences ended early (client gone, stop string, shutdown); their caches are freed.",
                    m.cancelled,
                ),
                (
                    "kakeya_batched_drafts_total",
                    "Draft tokens verified beside other sequences' steps in batched decode forwards.",
                    m.drafts_in_batch,
                ),
                (
                    "kakeya_batched_drafts_accepted_total",
                    "Of those, the drafts accepted.",
                    m.drafts_in_batch_accepted,
                ),
                (
                    "kakeya_prefix_cache_hits_total",
                    "Prompts that took a prefix's K/V from the prefix cache.",
                    m.prefix.hits,
                ),
                (
                    "kakeya_prefix_cache_misses_total",
                    "Prompts that found no prefix worth taking in the prefix cache.",
                    m.prefix.misses,
                ),
                (
                    "kakeya_prefix_cache_reused_tokens_total",
                    "Prompt tokens whose K/V came from the prefix cache instead of a forward.",
                    m.prefix.reused_tokens,
                ),
                (
                    "kakeya_prefix_cache_evictions_total",
                    "Finished sequences dropped from the prefix cache to stay within its budget.",
                    m.prefix.evictions,
                ),
                (
                    "kakeya_forwards_recorded_total",
                    "Greedy forwards recorded for replay on a GPU (a CUDA graph each).",
                    m.replays.recorded as u64,
                ),
                (
                    "kakeya_forwards_replayed_total",
                    "Greedy forwards replayed from a recording on a GPU.",
                    m.replays.replayed as u64,
                ),
                (
                    "kakeya_forwards_replay_declined_total",
                    "Greedy forwards that could be recorded, issued kernel by kernel instead (first sightings, caches that are not plain buffers).",
                    m.replays.declined as u64,
                ),
                (
                    "kakeya_connections_refused_total",
                    "Connections past the cap, answered 503 and closed.",
                    m.connections_refused,
                ),
            ];
            for (name, help, v) in counters {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
            }
            let gauges = [
                ("kakeya_kv_bytes", "K/V bytes held by running sequences (every part).", m.kv_bytes),
                ("kakeya_queue_depth", "Requests waiting for a sequence slot.", m.queue_depth),
                ("kakeya_running_sequences", "Sequences prefilling or decoding.", m.running),
                ("kakeya_connections_open", "HTTP connections open.", m.connections_open),
                (
                    "kakeya_prefix_cache_bytes",
                    "Bytes held by the prefix cache's finished sequences (K/V and store, measured).",
                    m.prefix_bytes,
                ),
                ("kakeya_prefix_cache_entries", "Finished sequences in the prefix cache.", m.prefix_entries),
            ];
            for (name, help, v) in gauges {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            }
            m.ttft.render(
                &mut out,
                "kakeya_time_to_first_token_seconds",
                "Arrival to the first token sent.",
            );
            m.itl.render(
                &mut out,
                "kakeya_inter_token_latency_seconds",
                "Time between tokens sent to a client.",
            );
            m.committed_per_forward.render(
                &mut out,
                "kakeya_acceptance_length",
                "Tokens committed per verifier forward of one sequence (speculative blocks: accepted drafts + 1).",
            );
            m.batch_rows.render(
                &mut out,
                "kakeya_batch_rows",
                "Sequences per batched decode forward.",
            );
            m.prompt_chunks.render(
                &mut out,
                "kakeya_prompt_chunks",
                "Sequences whose prompt chunk ran, per forward that ran any.",
            );
            out
        })
    }
}
