//! The run's messages to the terminal (stderr). A data-parallel run whose ranks are threads of
//! one process (`--devices`) would print every setup line once per rank: the threads of ranks
//! other than 0 are quiet ([`set_quiet`]), and rank 0 speaks for the run. Errors are not
//! messages: they reach `main` as values, whichever rank they come from.

use std::cell::Cell;

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Makes this thread's [`say`] print nothing (`true`) or print again (`false`).
pub fn set_quiet(quiet: bool) {
    QUIET.with(|q| q.set(quiet));
}

/// Whether this thread's messages are dropped.
pub fn quiet() -> bool {
    QUIET.with(Cell::get)
}

/// Prints one line to stderr, unless this thread is quiet.
pub fn say(line: std::fmt::Arguments<'_>) {
    if !quiet() {
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_is_per_thread() {
        set_quiet(true);
        assert!(quiet());
        assert!(!std::thread::spawn(quiet).join().unwrap());
        set_quiet(false);
        assert!(!quiet());
    }
}
