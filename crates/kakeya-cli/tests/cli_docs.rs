//! The documentation against the binary: every command of the README's Commands block takes
//! exactly the flags listed for it there (each documented flag exists, each flag `--help`
//! shows is documented), and every `kakeya ...` command in a shell block of the README or
//! `docs/` names a command and flags that exist.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use common::kakeya;

/// What `[--model ...]` stands for in the Commands block.
const MODEL_FLAGS: [&str; 5] = [
    "--model",
    "--tokenizer",
    "--device",
    "--kernel",
    "--no-graph",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn help(path: &[String]) -> String {
    let out = kakeya().args(path).arg("--help").output().unwrap();
    assert!(out.status.success(), "kakeya {path:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// `--flags` in `text`.
fn flags(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("--") {
        let tail = &rest[i + 2..];
        let n = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
            .unwrap_or(tail.len());
        let before = rest[..i].chars().last();
        if n > 0 && before.is_none_or(|c| c.is_whitespace() || "[(|".contains(c)) {
            out.insert(format!("--{}", &tail[..n]));
        }
        rest = &tail[n..];
    }
    out
}

/// The flags `kakeya path --help` lists (not `--help`, `--version`).
fn help_flags(path: &[String]) -> BTreeSet<String> {
    let text = help(path);
    let options = text.split("Options:").nth(1).unwrap_or("");
    options
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix("-")
                .filter(|s| !s.starts_with('-'))
                .map_or(l, |s| s.split_once(", ").map_or(s, |(_, rest)| rest));
            l.starts_with("--")
                .then(|| flags(l).into_iter().next())
                .flatten()
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// The subcommands `kakeya path --help` lists.
fn subcommands(path: &[String]) -> Vec<String> {
    let text = help(path);
    let Some(section) = text.split("Commands:").nth(1) else {
        return Vec::new();
    };
    let section = section.split("Options:").next().unwrap_or("");
    section
        .lines()
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

/// Every command that runs (with its own flags), as word paths.
fn commands() -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut todo = vec![Vec::new()];
    while let Some(path) = todo.pop() {
        let subs = subcommands(&path);
        if !path.is_empty() && (subs.is_empty() || !help_flags(&path).is_empty()) {
            out.push(path.clone());
        }
        for s in subs {
            let mut p = path.clone();
            p.push(s);
            todo.push(p);
        }
    }
    out.sort();
    out
}

/// The command path a line of a synopsis or shell block starts with, after `kakeya`.
fn command_path(words: &[&str]) -> Vec<String> {
    words
        .iter()
        .take_while(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .take_while(|w| !w.starts_with('-'))
        .map(|w| (*w).to_string())
        .collect()
}

/// Flags of a synopsis line, `[--model ...]` expanded.
fn synopsis_flags(line: &str) -> BTreeSet<String> {
    let mut f = flags(line);
    if line.contains("--model ...") {
        f.extend(MODEL_FLAGS.iter().map(|s| (*s).to_string()));
    }
    f
}

/// The README's Commands block: per command path, the flags it lists.
fn documented() -> BTreeMap<Vec<String>, BTreeSet<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let block = readme
        .split("## Commands")
        .nth(1)
        .and_then(|s| s.split("```sh").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("the README's Commands block");
    let all = commands();
    let mut doc: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut current: Option<Vec<String>> = None;
    for line in block.lines() {
        if let Some(rest) = line.strip_prefix("kakeya ") {
            let code = rest.split(" # ").next().unwrap_or(rest);
            let words: Vec<&str> = code.split_whitespace().collect();
            let path = command_path(&words);
            doc.entry(path.clone())
                .or_default()
                .extend(synopsis_flags(code));
            current = Some(path);
        } else if let Some(note) = line.strip_prefix("# ") {
            let (who, what) = note
                .split_once(" also take:")
                .expect("a `... also take:` line");
            for item in who.replace(" and ", ",").split(',') {
                let item: Vec<String> = item.split_whitespace().map(String::from).collect();
                for c in all.iter().filter(|c| c.starts_with(&item)) {
                    doc.entry(c.clone()).or_default().extend(flags(what));
                }
            }
        } else if let Some(path) = &current {
            let code = line.split(" # ").next().unwrap_or(line);
            doc.entry(path.clone())
                .or_default()
                .extend(synopsis_flags(code));
        }
    }
    doc
}

#[test]
fn every_command_takes_exactly_the_flags_the_readme_lists() {
    let doc = documented();
    let mut problems = Vec::new();
    for c in commands() {
        let have = help_flags(&c);
        let listed = doc.get(&c).cloned().unwrap_or_default();
        let name = c.join(" ");
        for f in have.difference(&listed) {
            problems.push(format!(
                "kakeya {name} {f}: not in the README's Commands block"
            ));
        }
        for f in listed.difference(&have) {
            problems.push(format!(
                "kakeya {name} {f}: documented, but the command has no such flag"
            ));
        }
    }
    for c in doc.keys() {
        if !commands().contains(c) {
            problems.push(format!(
                "kakeya {}: documented, but no such command",
                c.join(" ")
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_kakeya_command_in_the_docs_exists_with_its_flags() {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let all = commands();
    let mut known: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        for block in text.split("```sh").skip(1) {
            let block = block.split("```").next().unwrap_or("").replace("\\\n", " ");
            for line in block.lines() {
                let line = line.split(" # ").next().unwrap_or(line);
                // Every `kakeya` (or `.../kakeya`) invocation on the line.
                for (i, _) in line.match_indices("kakeya ") {
                    let before = line[..i].chars().last();
                    if before.is_some_and(|c| !(c.is_whitespace() || c == '/' || c == '(')) {
                        continue;
                    }
                    let rest = &line[i + "kakeya ".len()..];
                    let end = rest.find(['|', ';', '>', '&']).unwrap_or(rest.len());
                    let words: Vec<&str> = rest[..end].split_whitespace().collect();
                    let path = command_path(&words);
                    let Some(cmd) = all
                        .iter()
                        .filter(|c| path.starts_with(c))
                        .max_by_key(|c| c.len())
                    else {
                        if !path.is_empty() {
                            problems.push(format!(
                                "{name}: `kakeya {}`: no such command",
                                path.join(" ")
                            ));
                        }
                        continue;
                    };
                    let have = known.entry(cmd.clone()).or_insert_with(|| help_flags(cmd));
                    for fl in flags(&rest[..end]) {
                        if !have.contains(&fl) && fl != "--help" {
                            problems.push(format!(
                                "{name}: `kakeya {}` has no flag {fl}",
                                cmd.join(" ")
                            ));
                        }
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} commands found in the docs");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
