//! Error chains that name each cause once.
//!
//! Every error type in sdtrain names its context in its own message ("cannot read x.json") and
//! chains the underlying error as its `source()`, never quoting it, so anyhow's `{:#}` gives each
//! cause once. Two helpers keep it that way:
//! - [`Chain`] shows a typed error and its causes on one line, the way `{:#}` does, for the places
//!   that show one without anyhow (a plain `{}` or `to_string()` shows only the first link).
//! - [`External`] holds an error from a crate that quotes its cause in its message and also
//!   returns it from `source()` (safetensors: `invalid JSON in header: {serde}`; hf-hub:
//!   `request error: {ureq}`; image's encoding errors), so that cause is not printed twice.

use std::error::Error;
use std::fmt;

/// Displays an error followed by each of its `source()`s, joined by `: ` (anyhow's `{:#}`).
#[derive(Clone, Copy)]
pub struct Chain<'a>(pub &'a dyn Error);

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}

/// `Chain(e).to_string()`: the error and its causes as one line.
pub fn chain_text(e: &dyn Error) -> String {
    Chain(e).to_string()
}

/// Another crate's error, as the last links of one of ours. Its message is shown as it is; a
/// cause whose text that message already ends with (the crate quoted it) is skipped, so `{:#}`
/// does not repeat it. A cause the message does not end with is chained as usual, so nothing
/// is lost.
#[derive(Debug)]
pub struct External<E>(pub E);

impl<E: fmt::Display> fmt::Display for External<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: Error> Error for External<E> {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        let shown = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            if !shown.ends_with(&c.to_string()) {
                return Some(c);
            }
            cause = c.source();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {path}")]
    struct Read {
        path: String,
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("loading the unet")]
    struct Load(#[source] Read);

    #[test]
    fn chain_names_each_cause_once_like_anyhow_alternate() {
        let err = Load(Read {
            path: "unet.safetensors".into(),
            source: std::io::Error::other("header too large"),
        });
        let want = "loading the unet: cannot read unet.safetensors: header too large";
        assert_eq!(chain_text(&err), want);
        assert_eq!(format!("{:#}", anyhow::Error::new(err)), want);
    }

    /// A crate's error that quotes its cause and chains it too (safetensors' header errors).
    #[derive(Debug, thiserror::Error)]
    #[error("invalid JSON in header: {0}")]
    struct Quoting(#[source] std::io::Error);

    /// A crate's error whose cause is not in its message.
    #[derive(Debug, thiserror::Error)]
    #[error("request failed")]
    struct Terse(#[source] std::io::Error);

    #[test]
    fn external_skips_only_a_cause_its_message_quotes() {
        let quoting = External(Quoting(std::io::Error::other("EOF at column 7")));
        let err = anyhow::Error::new(quoting).context("x.safetensors is not a valid file");
        assert_eq!(
            format!("{err:#}"),
            "x.safetensors is not a valid file: invalid JSON in header: EOF at column 7"
        );
        let terse = External(Terse(std::io::Error::other("connection reset")));
        assert_eq!(chain_text(&terse), "request failed: connection reset");
    }
}
