//! Ctrl-C handling: the first SIGINT sets a flag that the loop checks at each step boundary, so
//! the run saves and exits 0; a second one exits at once (the user insisted).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// A flag set by Ctrl-C.
#[derive(Clone, Default)]
pub struct Interrupt {
    flag: Arc<AtomicBool>,
}

impl Interrupt {
    /// Installs the process-wide Ctrl-C handler. Installing twice in one process (tests) keeps
    /// the first handler and returns a flag that is never set.
    pub fn install() -> Self {
        let me = Self::default();
        let flag = me.flag.clone();
        let presses = AtomicUsize::new(0);
        let installed = ctrlc::set_handler(move || {
            if presses.fetch_add(1, Ordering::SeqCst) >= 1 {
                eprintln!("\nsecond Ctrl-C: exiting without saving");
                std::process::exit(130);
            }
            eprintln!(
                "\nCtrl-C: finishing this step, saving, then exiting (Ctrl-C again to abort)"
            );
            flag.store(true, Ordering::SeqCst);
        });
        if let Err(e) = installed {
            eprintln!("warning: cannot install the Ctrl-C handler: {e}");
        }
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
