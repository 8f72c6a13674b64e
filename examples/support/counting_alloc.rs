//! A global allocator that counts the bytes the process holds on the host heap, now and at its
//! peak, for the benchmarks' activation census on the CPU (candle's CPU tensors are heap `Vec`s,
//! so after a forward pass the growth over the weights is what the autograd graph keeps).
//!
//! With [`trace_peaks`] on, it also records where each large allocation was made and, whenever
//! the peak grows, which of them are live: [`peak_composition`] then says what the peak is made
//! of. Slow (a backtrace per large allocation), for finding what a step's peak holds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::backtrace::Backtrace;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct CountingAlloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Whether large allocations and peaks are traced ([`trace_peaks`]).
static TRACING: AtomicBool = AtomicBool::new(false);
/// The peak at the last snapshot.
static TRACED: AtomicUsize = AtomicUsize::new(0);
/// Allocations of at least this many bytes are traced.
const LARGE: usize = 256 << 10;
/// A new snapshot is taken once the peak has grown this much past the last one.
const TRACE_STEP: usize = 256 << 10;

/// A traced allocation: its size and where it was made.
type Site = (usize, Arc<Backtrace>);

#[derive(Default)]
struct Trace {
    /// Live traced allocations by address.
    live: HashMap<usize, Site>,
    /// The bytes held at the last snapshot, with the traced allocations live then.
    at_peak: Option<(usize, Vec<Site>)>,
}

static TRACE: Mutex<Option<Trace>> = Mutex::new(None);

thread_local! {
    /// Set while this thread updates the trace; allocations made meanwhile only count.
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` on the trace unless this thread is already inside it (the tracer's own allocations
/// only count). `site` is captured first when asked for, under the same guard.
fn with_trace(capture: bool, f: impl FnOnce(&mut Trace, Option<Arc<Backtrace>>)) {
    if IN_TRACE.with(|g| g.replace(true)) {
        return;
    }
    let site = capture.then(|| Arc::new(Backtrace::force_capture()));
    if let Ok(mut slot) = TRACE.lock() {
        f(slot.get_or_insert_with(Trace::default), site);
    }
    IN_TRACE.with(|g| g.set(false));
}

fn grow(ptr: *mut u8, n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    let before = PEAK.fetch_max(now, Ordering::Relaxed);
    if !TRACING.load(Ordering::Relaxed) || IN_TRACE.with(Cell::get) {
        return;
    }
    let snapshot = now > before && now >= TRACED.load(Ordering::Relaxed) + TRACE_STEP;
    if n < LARGE && !snapshot {
        return;
    }
    with_trace(n >= LARGE, |t, site| {
        if let Some(site) = site {
            t.live.insert(ptr as usize, (n, site));
        }
        if snapshot {
            TRACED.store(now, Ordering::Relaxed);
            t.at_peak = Some((now, t.live.values().cloned().collect()));
        }
    });
}

fn shrink(ptr: *mut u8, n: usize) {
    LIVE.fetch_sub(n, Ordering::Relaxed);
    if n >= LARGE && TRACING.load(Ordering::Relaxed) {
        with_trace(false, |t, _| {
            t.live.remove(&(ptr as usize));
        });
    }
}

// SAFETY: every call forwards to `System` unchanged; the counters are only statistics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(p, layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(p, layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrink(ptr, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrink(ptr, layout.size());
            grow(p, new_size);
        }
        p
    }
}

/// Bytes held on the heap now.
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Restarts the peak at the bytes held now.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    TRACED.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    with_trace(false, |t, _| t.at_peak = None);
}

/// Traces (`true`) large allocations and the peak from now on, or stops and forgets the live
/// set (`false`; what the last snapshot holds stays for [`peak_composition`]).
pub fn trace_peaks(on: bool) {
    TRACING.store(on, Ordering::Relaxed);
    if !on {
        with_trace(false, |t, _| t.live.clear());
    }
}

/// The bytes held at the last snapshot of the peak since [`reset_peak`] (within 256 KiB of it),
/// and the traced allocations live then as (bytes, formatted backtrace), largest first.
pub fn peak_composition() -> Option<(usize, Vec<(usize, String)>)> {
    let mut taken = None;
    with_trace(false, |t, _| taken = t.at_peak.take());
    let (held, sites) = taken?;
    let mut out: Vec<(usize, String)> = sites.iter().map(|(n, bt)| (*n, bt.to_string())).collect();
    out.sort_by_key(|s| std::cmp::Reverse(s.0));
    Some((held, out))
}

/// The most bytes held since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}
