//! The one-screen summary printed at the end of a run.

use std::fmt;

use super::outcome::TrainOutcome;

pub struct Summary<'a>(pub &'a TrainOutcome);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = self.0;
        progress(f, o)?;
        losses(f, o)?;
        data(f, o)?;
        incidents(f, o)?;
        for dir in &o.saved {
            writeln!(f, "saved           {}", dir.display())?;
        }
        Ok(())
    }
}

/// The status line, the run folder, how far the run got and what it cost in time and memory.
fn progress(f: &mut fmt::Formatter<'_>, o: &TrainOutcome) -> fmt::Result {
    let status = if o.interrupted {
        "interrupted (Ctrl-C), saved"
    } else {
        "finished"
    };
    writeln!(f, "== sdtrain run {status}")?;
    writeln!(f, "run folder      {}", o.run_dir.display())?;
    writeln!(
        f,
        "steps           {} ({} epochs completed)",
        o.steps, o.epochs_completed
    )?;
    writeln!(f, "images seen     {}", o.images_seen)?;
    writeln!(
        f,
        "wall time       {:.1} s ({:.2} images/s)",
        o.wall_secs,
        o.images_seen as f64 / o.wall_secs.max(1e-9)
    )?;
    if let Some(m) = &o.memory {
        writeln!(f, "memory          {}", m.describe())?;
    }
    if let Some(cap) = &o.vram_cap {
        writeln!(f, "vram cap        {cap}; the peak above is under it")?;
    }
    Ok(())
}

/// The training loss's first and last fifth, and the first and last validation loss.
fn losses(f: &mut fmt::Formatter<'_>, o: &TrainOutcome) -> fmt::Result {
    if let Some((first, last)) = o.first_last_loss() {
        writeln!(
            f,
            "loss            first 20% of steps {first:.4}, last 20% {last:.4}"
        )?;
    }
    if let (Some(first), Some(last)) = (o.val_losses.first(), o.val_losses.last()) {
        writeln!(
            f,
            "validation      loss {:.4} at step {}, {:.4} at step {} ({} images, {} evaluations)",
            first.1,
            first.0,
            last.1,
            last.0,
            o.val_images,
            o.val_losses.len()
        )?;
    }
    Ok(())
}

/// How the data was batched, cached and left out.
fn data(f: &mut fmt::Formatter<'_>, o: &TrainOutcome) -> fmt::Result {
    if o.buckets.len() > 1 {
        let list: Vec<String> = o
            .buckets
            .iter()
            .map(|c| format!("{} ×{}", c.bucket, c.images))
            .collect();
        writeln!(f, "aspect buckets  {}", list.join(", "))?;
    }
    if o.repeated_samples > 0 {
        writeln!(
            f,
            "runt batches    {} samples repeated to fill them (EveryDream2's rule; none dropped)",
            o.repeated_samples
        )?;
    }
    for line in &o.caches {
        writeln!(f, "cache           {line}")?;
    }
    if o.failed_samples > 0 {
        writeln!(
            f,
            "left out        {} samples whose file failed to decode (listed above)",
            o.failed_samples
        )?;
    }
    Ok(())
}

/// Skipped steps, OOM retries and skipped images, each only when there were any.
fn incidents(f: &mut fmt::Formatter<'_>, o: &TrainOutcome) -> fmt::Result {
    if o.skipped_steps > 0 {
        writeln!(
            f,
            "skipped steps   {} (non-finite loss or gradient, or no decodable image)",
            o.skipped_steps
        )?;
    }
    if o.micro.oom_retries > 0 {
        writeln!(
            f,
            "oom retries     {} (micro-batch now {}; effective batch unchanged)",
            o.micro.oom_retries, o.micro.size
        )?;
    }
    if o.skipped_images > 0 {
        writeln!(
            f,
            "skipped images  {} (unreadable; listed above)",
            o.skipped_images
        )?;
    }
    Ok(())
}
