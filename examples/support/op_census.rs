//! `bench_step --op-census` (feature `op-census`): one training step's candle storage ops counted
//! by kind with the bytes each writes (vendored candle-core's `census` module), and the call
//! sites of the strided copies, casts and broadcast binaries, attributed to the first sdtrain
//! frames of a backtrace (and, inside the backward pass, to the forward op whose gradient rule
//! ran). A JSON object for the report line, and a table on stderr.

use anyhow::{Context, Result};
use serde_json::Value;

use super::bench::arg;

/// Starts counting (before the last step): `--op-census-depth N` (1) sdtrain frames name a call
/// site; `--op-census-sites a,b` records the sites of the kinds containing `a` or `b` instead of
/// the copies (`copy_strided:*`: candle's `ucopy` kernel on CUDA when strided, a device memcpy
/// when not; `copy2d`), casts and broadcast binaries (`all`: every kind).
pub fn start(args: &[String]) -> Result<()> {
    let depth = arg(args, "--op-census-depth", "1")
        .parse()
        .context("--op-census-depth")?;
    let sites = arg(args, "--op-census-sites", "copy,to_dtype,:bcast");
    let sites = match sites.as_str() {
        "all" => vec![String::new()],
        list => list.split(',').map(str::to_string).collect(),
    };
    on::start(depth, sites)
}

/// Stops counting; the counts as JSON (totals, by class, by kind, the `--op-census-top N` (25)
/// call sites) and as a table on stderr.
pub fn finish(args: &[String]) -> Result<Value> {
    let top = arg(args, "--op-census-top", "25")
        .parse()
        .context("--op-census-top")?;
    on::finish(top)
}

#[cfg(not(feature = "op-census"))]
mod on {
    use anyhow::{bail, Result};
    use serde_json::Value;

    pub fn start(_: usize, _: Vec<String>) -> Result<()> {
        bail!("--op-census needs the op-census feature (cargo run --features op-census ...)")
    }

    pub fn finish(_: usize) -> Result<Value> {
        bail!("--op-census needs the op-census feature")
    }
}

#[cfg(feature = "op-census")]
mod on {
    use anyhow::Result;
    use candle_core::census::{self, Config, Count, Snapshot};
    use serde_json::{json, Value};

    /// Counting starts; the call sites of the kinds containing one of `site_kinds` are recorded.
    pub fn start(depth: usize, site_kinds: Vec<String>) -> Result<()> {
        census::start(Config {
            crate_prefix: "sdtrain::".to_string(),
            source_prefix: "./src/".to_string(),
            site_kinds,
            depth,
        });
        Ok(())
    }

    pub fn finish(top: usize) -> Result<Value> {
        census::stop();
        let snap = census::snapshot();
        print_table(&snap, top);
        Ok(to_json(&snap, top))
    }

    /// The class of a kind: its text before the first `:` (`binary:add:bcast` is `binary`).
    fn class(kind: &str) -> &str {
        kind.split(':').next().unwrap_or(kind)
    }

    fn by_class(snap: &Snapshot) -> Vec<(String, Count)> {
        let mut classes: Vec<(String, Count)> = Vec::new();
        for (kind, c) in &snap.ops {
            let name = class(kind);
            match classes.iter_mut().find(|(n, _)| n == name) {
                Some((_, t)) => {
                    t.calls += c.calls;
                    t.bytes += c.bytes;
                }
                None => classes.push((name.to_string(), *c)),
            }
        }
        classes.sort_by_key(|c| std::cmp::Reverse(c.1.calls));
        classes
    }

    fn mib(bytes: u64) -> f64 {
        (bytes as f64 / (1u64 << 20) as f64 * 100.0).round() / 100.0
    }

    fn to_json(snap: &Snapshot, top: usize) -> Value {
        let total = snap.ops.iter().fold(Count::default(), |mut t, (_, c)| {
            t.calls += c.calls;
            t.bytes += c.bytes;
            t
        });
        let row =
            |name: &str, c: &Count| json!({"kind": name, "calls": c.calls, "mib": mib(c.bytes)});
        json!({
            "ops": total.calls,
            "mib_written": mib(total.bytes),
            "by_class": by_class(snap).iter().map(|(n, c)| row(n, c)).collect::<Vec<_>>(),
            "by_kind": snap.ops.iter().map(|(n, c)| row(n, c)).collect::<Vec<_>>(),
            "sites": snap.sites.iter().take(top).map(|s| json!({
                "kind": s.kind,
                "backward_of": s.backward_of,
                "site": s.frames,
                "calls": s.count.calls,
                "mib": mib(s.count.bytes),
            })).collect::<Vec<_>>(),
        })
    }

    fn print_table(snap: &Snapshot, top: usize) {
        eprintln!("op census, one step: by class");
        for (n, c) in by_class(snap) {
            eprintln!("{:>8} {:>10.1} MiB  {n}", c.calls, mib(c.bytes));
        }
        eprintln!("by kind");
        for (n, c) in &snap.ops {
            eprintln!("{:>8} {:>10.1} MiB  {n}", c.calls, mib(c.bytes));
        }
        eprintln!("top call sites");
        for s in snap.sites.iter().take(top) {
            let bwd = if s.backward_of.is_empty() {
                String::new()
            } else {
                format!(" bwd[{}]", s.backward_of)
            };
            eprintln!(
                "{:>8} {:>10.1} MiB  {}{bwd}  {}",
                s.count.calls,
                mib(s.count.bytes),
                s.kind,
                s.frames
            );
        }
    }
}
