//! Every arrow points down: each `crate::X` path in src/ (in a `use` line, grouped
//! `use crate::{X::…, Y::…}` included, or written inline as `crate::X::f()`) must name a
//! top-level module in a layer below the importing file's own, or its own module. Comments and
//! string literals are not read.
//!
//! The layers, top to bottom ([`LAYERS`]):
//!
//! ```text
//! cli, main         the command line
//! inspect, inspect_adapter   `sdtrain inspect` (models, adapter files)
//! train             the run
//! config            train.json → the plan
//! sample            sampling (during a run and `sdtrain sample`)
//! adapter, data, diffusion
//! model             UNet, text encoders, VAE, loading
//! nn, optim, memory
//! weights, tensorboard, dist, torch_pickle      leaves built on the leaves below
//! fsutil, tensor_view, kernel_emu, precision, run_layout, error_chain, console, linalg   leaves
//! ```
//!
//! Modules in the same layer do not import each other: a module that needs a sibling belongs in
//! a layer of its own. A new top-level module must be given a layer here before it can be
//! imported. `super::` paths stay inside their top-level module in today's code and are not
//! checked.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The layers, top first. A module may import from any later layer.
const LAYERS: &[&[&str]] = &[
    &["cli", "main"],
    &["inspect", "inspect_adapter"],
    &["train"],
    &["config"],
    &["sample"],
    &["adapter", "data", "diffusion"],
    &["model"],
    &["nn", "optim", "memory"],
    &["weights", "tensorboard", "dist", "torch_pickle"],
    &[
        "fsutil",
        "file_sniff",
        "text_file",
        "tensor_view",
        "kernel_emu",
        "precision",
        "run_layout",
        "error_chain",
        "console",
        "py_json",
        "linalg",
    ],
];

/// Upward imports that are known and being removed, as (importing module, imported path
/// prefix, why). An entry that no longer matches anything fails the test, so the list only
/// shrinks.
const KNOWN_UPWARD: &[(&str, &str, &str)] = &[(
    "train",
    "cli::exit_code",
    "retry_tests.rs (test code) checks the exit code a GaveUp maps to",
)];

/// One `crate::…` path found in a file.
#[derive(Debug, Clone, PartialEq)]
struct Import {
    /// 1-based.
    line: usize,
    /// The path after `crate::`, e.g. `train::resume::STATE_FILE`; a group gives one per
    /// member (`config::{A, B}`: `config::A` and `config::B`).
    path: String,
}

impl Import {
    fn top(&self) -> &str {
        self.path.split("::").next().unwrap_or_default()
    }
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// The top-level module a file under src/ belongs to: `src/train/step.rs` → `train`,
/// `src/cli.rs` → `cli`; `None` for lib.rs, which only declares the modules.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_string())
}

/// `text` with comments and the contents of string and char literals blanked out (newlines
/// kept, so line numbers stay right).
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && matches!(next, Some('"') | Some('#')) && is_raw_start(&chars, i) {
            // r"…", r#"…"#: ends at a quote followed by as many hashes.
            let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
            i += 2 + hashes;
            while i < chars.len() {
                let closes = chars[i] == '"'
                    && chars[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes;
                if closes {
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(chars[i]));
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if let Some(&ch) = chars.get(i) {
                    out.push(blank(ch));
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            // '\n', '\'', '\u{…}'
            i += 2;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether the `r` at `i` starts a raw string (and is not the end of an identifier).
fn is_raw_start(chars: &[char], i: usize) -> bool {
    let prev_ident = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
    let after_hashes = chars[i + 1..].iter().find(|&&h| h != '#');
    !prev_ident && after_hashes == Some(&'"')
}

/// Every `crate::` path in `code` (already through [`code_only`]).
fn imports(code: &str) -> Vec<Import> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("crate::") {
        let start = from + at;
        from = start + "crate::".len();
        let prev = start.checked_sub(1).map(|p| bytes[p] as char);
        if prev.is_some_and(|p| p.is_alphanumeric() || p == '_') {
            continue; // `mycrate::`
        }
        let line = code[..start].matches('\n').count() + 1;
        for path in paths_at(&code[from..]) {
            out.push(Import { line, path });
        }
    }
    out
}

/// The paths `text` starts with: `a::b::C` is one, `a::{b, c::{D, E}}` is `a::b`, `a::c::D`
/// and `a::c::E`, and `{a, b}` is `a` and `b`.
fn paths_at(text: &str) -> Vec<String> {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(text.len());
    let prefix = &text[..end];
    match text[end..].strip_prefix('{') {
        Some(group) if prefix.is_empty() || prefix.ends_with("::") => group_members(group)
            .into_iter()
            .flat_map(|m| paths_at(m.trim()))
            .map(|p| format!("{prefix}{p}"))
            .collect(),
        _ => {
            let path = prefix.trim_end_matches(':');
            if path.is_empty() {
                Vec::new()
            } else {
                vec![path.to_string()]
            }
        }
    }
}

/// The members of a `{…}` group (the text after its `{`), as written.
fn group_members(group: &str) -> Vec<&str> {
    let mut members = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                members.push(&group[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                members.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    members
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// What is wrong with `import` in a file of module `from`, if anything.
fn check(from: &str, import: &Import) -> Option<String> {
    let to = import.top();
    if to == from {
        return None;
    }
    let Some(from_layer) = layer_of(from) else {
        return Some(format!(
            "module `{from}` is in no layer: add it to LAYERS in tests/module_arrows.rs"
        ));
    };
    let Some(to_layer) = layer_of(to) else {
        return Some(format!(
            "`crate::{}`: `{to}` is in no layer: add it to LAYERS in tests/module_arrows.rs",
            import.path
        ));
    };
    if to_layer > from_layer {
        return None;
    }
    let direction = if to_layer == from_layer {
        "a sibling in the same layer"
    } else {
        "a layer above"
    };
    Some(format!(
        "`crate::{}` points up: {from} imports {to}, {direction}",
        import.path
    ))
}

fn known(from: &str, import: &Import) -> Option<usize> {
    KNOWN_UPWARD
        .iter()
        .position(|(m, prefix, _)| *m == from && import.path.starts_with(prefix))
}

#[test]
fn every_arrow_points_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 50, "src/ has {} .rs files?", files.len());
    let mut problems = String::new();
    let mut used = vec![false; KNOWN_UPWARD.len()];
    for file in &files {
        let Some(from) = module_of(&src, file) else {
            continue;
        };
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        for import in imports(&code) {
            let Some(problem) = check(&from, &import) else {
                continue;
            };
            if let Some(k) = known(&from, &import) {
                used[k] = true;
                continue;
            }
            let rel = file.strip_prefix(root).unwrap_or(file);
            writeln!(problems, "{}:{}: {problem}", rel.display(), import.line).unwrap();
        }
    }
    for ((from, prefix, why), used) in KNOWN_UPWARD.iter().zip(used) {
        if !used {
            writeln!(
                problems,
                "KNOWN_UPWARD lists {from} → crate::{prefix} ({why}), which no file imports any \
                 more: remove the entry"
            )
            .unwrap();
        }
    }
    let layers: Vec<String> = LAYERS.iter().map(|l| l.join("/")).collect();
    assert!(
        problems.is_empty(),
        "imports against the layers ({}):\n{problems}",
        layers.join(" → ")
    );
}

#[test]
fn imports_are_found_in_every_form() {
    let text = r#"
use crate::config::{TrainPlan, TrainMode};
use crate::{model::pipeline::StableDiffusion, train::{resume, step::x}};
// use crate::commented::Out;
/* crate::blocked::Out */
let s = "crate::quoted::Out"; let r = r"crate::raw::Out"; let c = '"';
let v = crate::sample::generate(x);
let w = mycrate::not::Ours;
"#;
    let found: Vec<(usize, String)> = imports(&code_only(text))
        .into_iter()
        .map(|i| (i.line, i.path))
        .collect();
    assert_eq!(
        found,
        [
            (2, "config::TrainPlan".to_string()),
            (2, "config::TrainMode".to_string()),
            (3, "model::pipeline::StableDiffusion".to_string()),
            (3, "train::resume".to_string()),
            (3, "train::step::x".to_string()),
            (7, "sample::generate".to_string()),
        ]
    );
}

#[test]
fn the_rule_names_the_arrow() {
    let import = |path: &str| Import {
        line: 1,
        path: path.into(),
    };
    assert_eq!(check("train", &import("config::TrainPlan")), None);
    assert_eq!(check("config", &import("config::x")), None);
    let up = check("config", &import("train::resume::STATE_FILE")).unwrap();
    assert!(up.contains("config imports train, a layer above"), "{up}");
    let sibling = check("data", &import("adapter::x")).unwrap();
    assert!(sibling.contains("a sibling in the same layer"), "{sibling}");
    let unknown = check("train", &import("newthing::x")).unwrap();
    assert!(unknown.contains("`newthing` is in no layer"), "{unknown}");
}
