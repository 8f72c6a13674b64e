//! The run folder's layout: what a run's folder and the folders inside it are called, and how a
//! run or a save point is recognised on disk. A leaf: both the plan (`resume_ckpt`,
//! `"findlast"`) and the trainer (creating, saving, resuming) read it, so neither has to ask
//! the other.
//!
//! ```text
//! <output_dir>/<project_name>-<YYYYmmdd-HHMMSS>[-N]/   a run folder
//!     plan.json                                      the resolved plan (makes it a run)
//!     epoch-0001/  final/  step-000010/              saved weights (full fine-tune)
//!     interrupted-step-000123/  errored-step-000123/
//!     state-step-000010/trainer_state.json           a complete save point
//!     state-step-000012.partial/                     a save cut short (ignored)
//! ```

use std::path::{Path, PathBuf};

/// The resolved plan, written into every run folder when the run starts.
pub const PLAN_FILE: &str = "plan.json";
/// The file that makes a folder a complete save point (written last).
pub const STATE_FILE: &str = "trainer_state.json";
/// A save point folder is this prefix and the step, `state-step-NNNNNN`.
pub const STATE_PREFIX: &str = "state-step-";

/// The timestamp in a run folder's name, `YYYYmmdd-HHMMSS` (EveryDream2's log folder name).
pub fn run_stamp(started: chrono::DateTime<chrono::Local>) -> String {
    started.format("%Y%m%d-%H%M%S").to_string()
}

/// A run folder's name: `<project>-<YYYYmmdd-HHMMSS>`, then `-2`, `-3`, … (`n`) when runs start
/// in the same second.
pub fn run_folder_name(project: &str, stamp: &str, n: usize) -> String {
    if n <= 1 {
        format!("{project}-{stamp}")
    } else {
        format!("{project}-{stamp}-{n}")
    }
}

/// The weights saved at the end of epoch `epoch` (1-based).
pub fn epoch_dir(run: &Path, epoch: usize) -> PathBuf {
    run.join(format!("epoch-{epoch:04}"))
}

/// The weights saved at the end of the run.
pub fn final_dir(run: &Path) -> PathBuf {
    run.join("final")
}

/// The weights saved on Ctrl-C after `step` steps.
pub fn interrupted_dir(run: &Path, step: usize) -> PathBuf {
    run.join(format!("interrupted-step-{step:06}"))
}

/// A step save (`save_every_n_steps`).
pub fn step_dir(run: &Path, step: usize) -> PathBuf {
    run.join(format!("step-{step:06}"))
}

/// The last completed step of a run that stopped on an out-of-memory error.
pub fn errored_dir(run: &Path, step: usize) -> PathBuf {
    run.join(format!("errored-step-{step:06}"))
}

/// The save point folder for `steps` completed steps in `run`.
pub fn state_dir(run: &Path, steps: usize) -> PathBuf {
    run.join(format!("{STATE_PREFIX}{steps:06}"))
}

/// Whether `dir` is a run folder (it holds [`PLAN_FILE`]).
pub fn is_run(dir: &Path) -> bool {
    dir.join(PLAN_FILE).is_file()
}

/// Whether `dir` is a complete save point (it holds [`STATE_FILE`]).
pub fn is_save_point(dir: &Path) -> bool {
    dir.join(STATE_FILE).is_file()
}

/// The complete save points in `run`, by step, oldest first.
pub fn save_points(run: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(run) else {
        return Vec::new();
    };
    let mut out: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| {
            let path = e.ok()?.path();
            let name = path.file_name()?.to_str()?;
            let step: usize = name.strip_prefix(STATE_PREFIX)?.parse().ok()?;
            is_save_point(&path).then_some((step, path))
        })
        .collect();
    out.sort();
    out
}

/// EveryDream2's `findlast`: the newest saved diffusers model under `output_dir` (a folder
/// holding `model_index.json`, newest by that file's time, searched `depth` levels down: a run's
/// `final/`, `epoch-NNNN/` or `step-NNNNNN/`): an EMA copy (`-ema`/`_ema`) when `ema`, else
/// not. `Err` when the newest is an errored save (EveryDream2 stops there too), `Ok(None)` when
/// there is none.
pub fn find_last_model(
    output_dir: &Path,
    depth: usize,
    ema: bool,
) -> Result<Option<PathBuf>, String> {
    type Best = Option<(std::time::SystemTime, PathBuf)>;
    fn walk(dir: &Path, depth: usize, want_ema: bool, best: &mut Best) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if !path.is_dir() {
                continue;
            }
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let ema = name.is_some_and(|n| n.ends_with("-ema") || n.ends_with("_ema"));
            let index = path.join("model_index.json");
            match std::fs::metadata(&index).and_then(|m| m.modified()) {
                Ok(t) if ema == want_ema && best.as_ref().is_none_or(|(b, _)| t > *b) => {
                    *best = Some((t, path.clone()))
                }
                Ok(_) => {}
                Err(_) if depth > 1 => walk(&path, depth - 1, want_ema, best),
                Err(_) => {}
            }
        }
    }
    let mut best = None;
    walk(output_dir, depth, ema, &mut best);
    match best {
        Some((_, p)) if p.to_string_lossy().contains("errored") => Err(format!(
            "the newest saved model under {} is {}, saved when a run failed; give the model \
             to start from",
            output_dir.display(),
            p.display()
        )),
        found => Ok(found.map(|(_, p)| p)),
    }
}

/// The newest run folder under `output_dir` with a complete save point (`resume_ckpt:
/// "last_run"`): the one whose newest save point was written last.
pub fn find_last_run(output_dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(output_dir).ok()?;
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| !save_points(p).is_empty())
        .max_by_key(|p| {
            let newest = save_points(p).pop().map(|(_, d)| d.join(STATE_FILE));
            newest.and_then(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
        })
}

/// The base model of the run `resume` names (a run folder or one of its save points), from the
/// run's [`PLAN_FILE`]. The error completes "`resume_ckpt` …".
pub fn model_of(resume: &Path) -> Result<String, String> {
    let run = if is_save_point(resume) {
        resume.parent().unwrap_or(resume)
    } else {
        resume
    };
    let plan = run.join(PLAN_FILE);
    let text = std::fs::read_to_string(&plan).map_err(|e| {
        format!(
            "names a run, but its {} cannot be read: {e}",
            plan.display()
        )
    })?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("names a run, but its {} is not JSON: {e}", plan.display()))?;
    value["model"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("names a run, but its {} has no `model`", plan.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_fixed_width() {
        let run = Path::new("out/p-20240101-000000");
        assert_eq!(
            run_folder_name("p", "20240101-000000", 1),
            "p-20240101-000000"
        );
        assert_eq!(
            run_folder_name("p", "20240101-000000", 3),
            "p-20240101-000000-3"
        );
        assert_eq!(epoch_dir(run, 2), run.join("epoch-0002"));
        assert_eq!(step_dir(run, 12), run.join("step-000012"));
        assert_eq!(state_dir(run, 12), run.join("state-step-000012"));
        assert_eq!(errored_dir(run, 1), run.join("errored-step-000001"));
        assert_eq!(interrupted_dir(run, 1), run.join("interrupted-step-000001"));
        assert_eq!(final_dir(run), run.join("final"));
    }

    /// A save point counts only with its state file; the run with the newest one is the last.
    #[test]
    fn save_points_and_the_last_run() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        for (run, steps) in [(&a, 2), (&b, 4)] {
            std::fs::create_dir_all(state_dir(run, steps)).unwrap();
            std::fs::write(run.join(PLAN_FILE), r#"{"model": "org/base"}"#).unwrap();
            std::fs::write(state_dir(run, steps).join(STATE_FILE), "{}").unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::fs::create_dir_all(state_dir(&a, 6)).unwrap();
        assert_eq!(save_points(&a), vec![(2, state_dir(&a, 2))]);
        assert_eq!(find_last_run(tmp.path()), Some(b.clone()));
        assert!(is_run(&b) && !is_save_point(&b) && is_save_point(&state_dir(&b, 4)));
        assert_eq!(model_of(&state_dir(&b, 4)).unwrap(), "org/base");
        assert!(model_of(tmp.path()).unwrap_err().contains("cannot be read"));
    }
}
