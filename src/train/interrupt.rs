//! Ctrl-C handling: the first SIGINT sets a flag that the loop checks at each step boundary, so
//! the run saves and exits 0; a second one exits at once (the user insisted).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A flag set by Ctrl-C.
#[derive(Clone, Default)]
pub struct Interrupt {
    flag: Arc<AtomicBool>,
}

/// The flags of the runs alive in this process: a data-parallel run's ranks are threads of one
/// process, each with its own flag, and tests run one run after another.
fn registry() -> &'static Mutex<Vec<Weak<AtomicBool>>> {
    static FLAGS: OnceLock<Mutex<Vec<Weak<AtomicBool>>>> = OnceLock::new();
    FLAGS.get_or_init(Default::default)
}

/// What Ctrl-C does: the first press sets every live flag, a second exits.
fn on_ctrl_c(presses: &AtomicUsize) {
    if presses.fetch_add(1, Ordering::SeqCst) >= 1 {
        eprintln!("\nsecond Ctrl-C: exiting without saving");
        std::process::exit(130);
    }
    eprintln!("\nCtrl-C: finishing this step, saving, then exiting (Ctrl-C again to abort)");
    let flags = registry().lock().unwrap_or_else(|e| e.into_inner());
    for f in flags.iter().filter_map(Weak::upgrade) {
        f.store(true, Ordering::SeqCst);
    }
}

impl Interrupt {
    /// A flag that the process-wide Ctrl-C handler sets. The handler is installed once per
    /// process, by the first call; every flag alive when Ctrl-C comes is set, so each rank of a
    /// data-parallel run (threads of one process) sees it.
    pub fn install() -> Self {
        static INSTALLED: OnceLock<()> = OnceLock::new();
        INSTALLED.get_or_init(|| {
            let presses = AtomicUsize::new(0);
            if let Err(e) = ctrlc::set_handler(move || on_ctrl_c(&presses)) {
                eprintln!("warning: cannot install the Ctrl-C handler: {e}");
            }
        });
        let me = Self::default();
        let mut flags = registry().lock().unwrap_or_else(|e| e.into_inner());
        flags.retain(|f| f.strong_count() > 0);
        flags.push(Arc::downgrade(&me.flag));
        me
    }

    pub fn requested(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Sets the flag by hand (tests, and a future `max_time` limit).
    pub fn request(&self) {
        self.flag.store(true, Ordering::SeqCst)
    }
}
