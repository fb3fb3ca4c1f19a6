//! A `kakeya serve` child process on an ephemeral loopback port, for the server tests.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kakeya_models::testing::{Scratch, write_tiny_served_model};
use serde_json::Value;

use super::http::{self, get, post};
use super::{kakeya, run_ok};

/// A running `kakeya serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
    pub stderr: mpsc::Receiver<String>,
}

impl Server {
    pub fn start(model: &Path, extra: &[&str]) -> Self {
        let mut cmd = kakeya();
        cmd.args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
            .args(extra);
        Self::spawn(cmd, "http")
    }

    /// Runs `cmd` (a `kakeya serve` on port 0, however launched) and waits for the address it
    /// prints after `scheme://`.
    pub fn spawn(mut cmd: std::process::Command, scheme: &str) -> Self {
        let mut child = cmd
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            let line = rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("the server printed its address");
            if let Some(rest) = line.split(&format!("{scheme}://")).nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        Self {
            child,
            addr,
            stderr: rx,
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> http::Response {
        post(&self.addr, path, body)
    }

    /// A metric's value (the first sample line starting with `name`).
    pub fn metric(&self, name: &str) -> f64 {
        let text = get(&self.addr, "/metrics").body;
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0.0, |v| v.parse().unwrap())
    }
}

impl Server {
    /// Waits (up to 30 s) until metric `name` reads `value` (the engine updates its gauges
    /// after it has answered).
    pub fn wait_metric(&self, name: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.metric(name) != value {
            assert!(
                Instant::now() < deadline,
                "{name} stays {}, not {value}",
                self.metric(name)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tiny model with the chat tokenizer (special turn tokens), and a random drafter for it.
pub fn tiny(s: &Scratch) -> (PathBuf, PathBuf) {
    write_tiny_served_model(&s.0).unwrap()
}

/// `kakeya infer --json` on `model` with `args`: its text and its JSON.
pub fn infer_text(model: &Path, args: &[&str]) -> (String, Value) {
    let mut all = vec!["infer", "--model", model.to_str().unwrap(), "--json"];
    all.extend(args);
    let v: Value = serde_json::from_str(&run_ok(&all)).unwrap();
    (v["text"].as_str().unwrap().to_string(), v)
}

/// The text a streamed answer adds up to, and its last chunk with a finish reason.
pub fn streamed(r: &http::Response, chat: bool) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let mut text = String::new();
    let mut last = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        text.push_str(piece.as_str().unwrap_or(""));
        if !c["finish_reason"].is_null() {
            last = v.clone();
        }
    }
    (text, last)
}
