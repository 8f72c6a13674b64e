//! kohya's `save_last_n_epochs` and `save_last_n_steps`: older saves' weights are removed as
//! new ones are written, so the newest remain (the retirement rule itself is checked against
//! kohya's functions in `train::saving`'s tests).

mod common;

use common::cli::{demo_data, run_folder, sdtrain, text, write_config};

fn saved(run: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
    names
}

/// Four epochs saved every epoch (the fourth is the final save, as kohya's last epoch is), the
/// last two kept; steps saved every 2, the last 2 steps
/// kept. Catches the removal of the wrong save (or of none), and the final save removed.
#[test]
fn the_newest_saves_remain() {
    let d = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"mode": "lora", "max_epochs": 4, "max_steps": null,
        "save_every_n_epochs": 1, "save_last_n_epochs": 2, "batch_size": 4,
        "adapter": {"rank": 2, "alpha": 2}});
    let path = write_config(d.path(), "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], d.path());
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("(save_last_n_epochs 2)"), "{log}");
    let names = saved(&run_folder(d.path()));
    assert_eq!(
        names,
        [
            "sdtrain-epoch-0002.safetensors",
            "sdtrain-epoch-0003.safetensors",
            "sdtrain.safetensors"
        ],
        "{log}"
    );
    // Every epoch's file is named in its header by the run's name alone, as kohya's
    // `ss_output_name` and ModelSpec title are its `output_name`.
    let bytes = std::fs::read(run_folder(d.path()).join(&names[0])).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    assert_eq!(meta["ss_output_name"], "sdtrain");
    assert_eq!(meta["modelspec.title"], "sdtrain");

    let d = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"mode": "lora", "max_steps": 8,
        "save_every_n_steps": 2, "save_last_n_steps": 2, "adapter": {"rank": 2, "alpha": 2}});
    let path = write_config(d.path(), "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--cpu"], d.path());
    assert!(out.status.success(), "{}", text(&out));
    let names = saved(&run_folder(d.path()));
    // Step 6 retires step 2 (6 − 2 − 1 = 3, down to a multiple of 2); the final save at step 8
    // retires step 4, as kohya's step save at 8 would.
    assert_eq!(
        names,
        ["sdtrain-step-000006.safetensors", "sdtrain.safetensors"],
        "{names:?}"
    );

    // Without the saves it keeps the last of, it is an error.
    let d = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"mode": "lora", "save_last_n_epochs": 2});
    let path = write_config(d.path(), "tiny-sd15", &demo_data(), cfg);
    let out = sdtrain(&["--config", path.to_str().unwrap(), "--dry-run"], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("save_every_n_epochs"), "{}", text(&out));
}
