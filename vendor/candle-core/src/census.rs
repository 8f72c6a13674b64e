//! Op census (feature `census`, sdtrain's patch): while collecting, every `Storage` op (and the
//! device's zero fills, random fills and host uploads) adds one call and the bytes it writes to
//! a count by kind, e.g. `binary:add:bcast`, `to_dtype:bf16->f32`, `copy_strided:strided`. Each
//! storage op is one or more kernel launches on CUDA, so the counts are a launch census that the
//! CPU can take. For the kinds named by `site_kinds` the call site is recorded too: a captured
//! backtrace attributed to the first `depth` frames of the crate named by `crate_prefix`, and,
//! inside `Tensor::backward`, to the forward op whose gradient rule is running (`bwd[Transpose]`).
//!
//! Off (the default), none of this is compiled in. On but not collecting, each op pays one
//! relaxed atomic load.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::op::Op;
use crate::Layout;

static COLLECTING: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<State>> = Mutex::new(None);

thread_local! {
    /// The forward op whose backward rule is running on this thread, if any.
    static BACKWARD_OF: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Calls and bytes written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub calls: u64,
    pub bytes: u64,
}

impl Count {
    fn add(&mut self, bytes: usize) {
        self.calls += 1;
        self.bytes += bytes as u64;
    }
}

/// What to attribute call sites to.
#[derive(Clone, Debug)]
pub struct Config {
    /// Symbol prefix of the crate whose frames name a call site, e.g. `sdtrain::`: a frame
    /// without line tables is the crate's when its symbol starts so.
    pub crate_prefix: String,
    /// Source path prefix of the crate's files as its line tables give them, e.g. `./src/`: a
    /// frame with line tables is the crate's when its file starts so (line tables name a
    /// function by its short name only).
    pub source_prefix: String,
    /// Kinds whose call sites are recorded: a kind is recorded when it contains one of these.
    pub site_kinds: Vec<String>,
    /// How many of that crate's frames (innermost first) name a site.
    pub depth: usize,
}

/// One recorded call site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub kind: String,
    /// `bwd[Op]` inside the backward pass, else empty.
    pub backward_of: String,
    /// `function (file:line)` frames, innermost first, joined by ` <- `; `(none)` when no frame
    /// of the crate is on the stack.
    pub frames: String,
    pub count: Count,
}

/// The counts since the last [`start`].
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// By kind, most calls first.
    pub ops: Vec<(String, Count)>,
    /// Most calls first.
    pub sites: Vec<Site>,
}

struct State {
    config: Config,
    ops: HashMap<String, Count>,
    sites: HashMap<(String, String, String), Count>,
}

/// Clears the counts and starts collecting.
pub fn start(config: Config) {
    let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    *state = Some(State {
        config,
        ops: HashMap::new(),
        sites: HashMap::new(),
    });
    COLLECTING.store(true, Ordering::Relaxed);
}

/// Stops collecting; the counts stay for [`snapshot`].
pub fn stop() {
    COLLECTING.store(false, Ordering::Relaxed);
}

/// Whether ops are being counted now.
#[inline]
pub fn collecting() -> bool {
    COLLECTING.load(Ordering::Relaxed)
}

/// The counts so far (empty if [`start`] was never called).
pub fn snapshot() -> Snapshot {
    let state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(state) = state.as_ref() else {
        return Snapshot::default();
    };
    let mut ops: Vec<(String, Count)> = state.ops.iter().map(|(k, c)| (k.clone(), *c)).collect();
    ops.sort_by(|a, b| b.1.calls.cmp(&a.1.calls).then_with(|| a.0.cmp(&b.0)));
    let mut sites: Vec<Site> = state
        .sites
        .iter()
        .map(|((kind, backward_of, frames), c)| Site {
            kind: kind.clone(),
            backward_of: backward_of.clone(),
            frames: frames.clone(),
            count: *c,
        })
        .collect();
    sites.sort_by(|a, b| {
        b.count
            .calls
            .cmp(&a.count.calls)
            .then_with(|| (&a.kind, &a.frames).cmp(&(&b.kind, &b.frames)))
    });
    Snapshot { ops, sites }
}

/// Counts one op of `kind` writing `bytes`, and its call site when `kind` is one of the
/// configured site kinds. Call only when [`collecting`].
pub(crate) fn record(kind: String, bytes: usize) {
    let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(state) = guard.as_mut() else {
        return;
    };
    let wants_site = state
        .config
        .site_kinds
        .iter()
        .any(|k| kind.contains(k.as_str()));
    if wants_site {
        let frames = frames(&state.config);
        let backward_of = BACKWARD_OF.with(|b| b.get()).unwrap_or_default();
        let key = (kind.clone(), backward_of.to_string(), frames);
        state.sites.entry(key).or_default().add(bytes);
    }
    state.ops.entry(kind).or_default().add(bytes);
}

/// Marks the backward rule of `op` as running on this thread until the guard drops.
pub(crate) fn backward_of(op: &Op) -> BackwardGuard {
    let previous = BACKWARD_OF.with(|b| b.replace(Some(op_name(op))));
    BackwardGuard(previous)
}

pub(crate) struct BackwardGuard(Option<&'static str>);

impl Drop for BackwardGuard {
    fn drop(&mut self) {
        BACKWARD_OF.with(|b| b.set(self.0));
    }
}

/// `:bcast` when a layout repeats elements (a zero stride on a dimension longer than one),
/// `:strided` when it is otherwise not contiguous, else nothing.
pub(crate) fn layout_tag(layouts: &[&Layout]) -> &'static str {
    let bcast = layouts.iter().any(|l| {
        l.dims()
            .iter()
            .zip(l.stride())
            .any(|(&d, &s)| d > 1 && s == 0)
    });
    if bcast {
        ":bcast"
    } else if layouts.iter().all(|l| l.is_contiguous()) {
        ""
    } else {
        ":strided"
    }
}

/// The first `depth` frames of the crate, innermost first, from a fresh backtrace.
fn frames(config: &Config) -> String {
    let text = std::backtrace::Backtrace::force_capture().to_string();
    let mut out: Vec<String> = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let Some((_, symbol)) = line.trim_start().split_once(": ") else {
            continue;
        };
        let at = match lines.peek() {
            Some(next) if next.trim_start().starts_with("at ") => {
                lines.next().map(|l| l.trim_start()[3..].to_string())
            }
            _ => None,
        };
        let ours = match &at {
            Some(a) => a.starts_with(config.source_prefix.as_str()),
            None => symbol
                .trim_start_matches('<')
                .starts_with(config.crate_prefix.as_str()),
        };
        if !ours {
            continue;
        }
        let place = at.map(|a| short_place(&a)).unwrap_or_default();
        out.push(format!("{symbol} ({place})"));
        if out.len() >= config.depth.max(1) {
            break;
        }
    }
    if out.is_empty() {
        "(none)".to_string()
    } else {
        out.join(" <- ")
    }
}

/// `src/nn/conv.rs:12` from `/home/me/sdtrain/src/nn/conv.rs:12:5` (the column dropped, the
/// path from its last `src/`).
fn short_place(at: &str) -> String {
    let no_col = match at.rsplit_once(':') {
        Some((head, col)) if col.chars().all(|c| c.is_ascii_digit()) => head,
        _ => at,
    };
    match no_col.rfind("src/") {
        Some(i) => no_col[i..].to_string(),
        None => no_col.to_string(),
    }
}

fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Binary(..) => "Binary",
        Op::Unary(..) => "Unary",
        Op::Cmp(..) => "Cmp",
        Op::Reduce(..) => "Reduce",
        Op::Matmul(..) => "Matmul",
        Op::Gather(..) => "Gather",
        Op::Scatter(..) => "Scatter",
        Op::ScatterAdd(..) => "ScatterAdd",
        Op::IndexSelect(..) => "IndexSelect",
        Op::IndexAdd(..) => "IndexAdd",
        Op::WhereCond(..) => "WhereCond",
        Op::Conv1D { .. } => "Conv1D",
        Op::ConvTranspose1D { .. } => "ConvTranspose1D",
        Op::Conv2D { .. } => "Conv2D",
        Op::ConvTranspose2D { .. } => "ConvTranspose2D",
        Op::AvgPool2D { .. } => "AvgPool2D",
        Op::MaxPool2D { .. } => "MaxPool2D",
        Op::UpsampleNearest1D { .. } => "UpsampleNearest1D",
        Op::UpsampleNearest2D { .. } => "UpsampleNearest2D",
        Op::UpsampleBilinear2D { .. } => "UpsampleBilinear2D",
        Op::Cat(..) => "Cat",
        Op::Affine { .. } => "Affine",
        Op::ToDType(..) => "ToDType",
        Op::Copy(..) => "Copy",
        Op::Broadcast(..) => "Broadcast",
        Op::Narrow(..) => "Narrow",
        Op::SliceScatter0(..) => "SliceScatter0",
        Op::Reshape(..) => "Reshape",
        Op::ToDevice(..) => "ToDevice",
        Op::Transpose(..) => "Transpose",
        Op::Permute(..) => "Permute",
        Op::Elu(..) => "Elu",
        Op::Powf(..) => "Powf",
        Op::CustomOp1(..) => "CustomOp1",
        Op::CustomOp2(..) => "CustomOp2",
        Op::CustomOp3(..) => "CustomOp3",
        Op::Attached(..) => "Attached",
    }
}
