//! Reading `torch.save` files without running them (src/torch_pickle): the tensors equal what
//! torch itself wrote out as safetensors, for every view and dtype a state dict may hold
//! (tests/fixtures/make_torch_files.py made both), a Lightning `.ckpt` gives its `state_dict`,
//! and a pickle that would run a command when torch loads it is read as data and runs nothing.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use sdtrain::torch_pickle::{self, TorchArchive};

fn torch_file(name: &str) -> std::path::PathBuf {
    common::fixture("torch-files").join(name)
}

/// `name → (dtype, shape, bytes)` of a safetensors file.
fn safetensors_entries(path: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let data = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = format!("{:?}", view.dtype());
            (name, (dtype, view.shape().to_vec(), view.data().to_vec()))
        })
        .collect()
}

fn converted(src: &Path, dir: &Path) -> (torch_pickle::Converted, std::path::PathBuf) {
    let out = dir.join("out.safetensors");
    let done = torch_pickle::convert(src, &out, Default::default()).unwrap();
    (done, out)
}

#[test]
fn every_view_and_dtype_reads_as_torch_wrote_it() {
    let dir = tempfile::tempdir().unwrap();
    let (done, out) = converted(&torch_file("views.pt"), dir.path());
    let got = safetensors_entries(&out);
    let want = safetensors_entries(&torch_file("views.safetensors"));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, w) in &want {
        assert_eq!(&got[name], w, "{name}");
    }
    assert_eq!(done.tensors, want.len());
    let mut skipped: Vec<&str> = done.skipped.iter().map(|(n, _)| n.as_str()).collect();
    skipped.sort();
    assert_eq!(skipped, ["name", "none", "step"]);
}

#[test]
fn tensors_load_in_memory_with_their_values() {
    let tensors: BTreeMap<_, _> = torch_pickle::read_tensors(&torch_file("views.pt"))
        .unwrap()
        .into_iter()
        .collect();
    let v = |n: &str| {
        tensors[n]
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    assert_eq!(v("i8"), [-128.0, -1.0, 0.0, 127.0]);
    assert_eq!(v("bool"), [1.0, 0.0, 1.0]);
    assert_eq!(v("f8"), [0.5, -2.0, 448.0, 0.0]);
    assert_eq!(v("nested.deeper.x"), [3.0, 3.0]);
    assert_eq!(tensors["transposed"].dims(), [6, 4]);
    // `transposed` is `same_a` transposed: a column-major view of the same storage.
    let t = tensors["same_a"].t().unwrap().contiguous().unwrap();
    let diff = (t - &tensors["transposed"]).unwrap().abs().unwrap();
    assert_eq!(diff.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn a_lightning_checkpoint_gives_its_state_dict() {
    let dir = tempfile::tempdir().unwrap();
    let (done, out) = converted(&torch_file("lightning.ckpt"), dir.path());
    assert_eq!(
        safetensors_entries(&out),
        safetensors_entries(&torch_file("lightning.safetensors"))
    );
    assert!(done.skipped.is_empty(), "{:?}", done.skipped);
}

#[test]
fn a_pickle_that_would_run_a_command_is_read_as_data() {
    let dir = tempfile::tempdir().unwrap();
    let (done, out) = converted(&torch_file("evil.pt"), dir.path());
    assert_eq!(safetensors_entries(&out).keys().collect::<Vec<_>>(), ["w"]);
    // torch.load would have called os.system("touch pwned-by-pickle") in the working folder.
    assert!(!Path::new("pwned-by-pickle").exists());
    assert_eq!(done.skipped.len(), 1);
    let (name, why) = &done.skipped[0];
    assert_eq!(name, "evil");
    assert!(
        why.contains("posix.system") || why.contains("os.system"),
        "{why}"
    );
}

#[test]
fn torchs_legacy_format_reads_as_the_zip_format() {
    // The same A1111 embedding saved both ways (tests/fixtures/make_torch_embeddings.py).
    let dir = tempfile::tempdir().unwrap();
    let emb = common::fixture("torch-embeddings");
    let (done, legacy) = converted(&emb.join("legacy.pt"), dir.path());
    let zip = dir.path().join("zip.safetensors");
    torch_pickle::convert(&emb.join("dogtok.pt"), &zip, Default::default()).unwrap();
    assert_eq!(safetensors_entries(&legacy), safetensors_entries(&zip));
    assert_eq!(
        safetensors_entries(&legacy).keys().collect::<Vec<_>>(),
        ["string_to_param.*"]
    );
    assert!(!done.skipped.is_empty());
    // Cut anywhere, refused naming the file.
    let whole = std::fs::read(emb.join("legacy.pt")).unwrap();
    for cut in (2..whole.len()).step_by(31) {
        let p = dir.path().join("cut-legacy.pt");
        std::fs::write(&p, &whole[..cut]).unwrap();
        let err = TorchArchive::open(&p).expect_err("a cut legacy file read");
        assert!(err.to_string().contains("cut-legacy.pt"), "{err}");
    }
}

#[test]
fn unreadable_torch_files_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();

    // Cut anywhere, the archive is refused with its path named, never a panic.
    let whole = std::fs::read(torch_file("views.pt")).unwrap();
    for cut in (0..whole.len()).step_by(97).chain([whole.len() - 1]) {
        let p = dir.path().join("cut.pt");
        std::fs::write(&p, &whole[..cut]).unwrap();
        let err = torch_pickle::convert(&p, &dir.path().join("o.safetensors"), Default::default())
            .expect_err("a cut archive read");
        assert!(format!("{err:#}").contains("cut.pt"), "{err:#}");
    }
    assert!(!dir.path().join("o.safetensors").exists());

    let text = dir.path().join("notes.ckpt");
    std::fs::write(&text, "not a checkpoint").unwrap();
    let err = TorchArchive::open(&text).unwrap_err();
    assert!(err.to_string().contains("not a zip archive"), "{err}");
}

/// `sdtrain` with sdtrain's cache in `cache`.
fn sdtrain_cached(args: &[&str], cwd: &Path, cache: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_sdtrain"))
        .args(args)
        .current_dir(cwd)
        .env("SDTRAIN_CACHE", cache)
        .output()
        .unwrap()
}

#[test]
fn a_ckpt_model_draws_what_its_safetensors_draws() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let ckpt = torch_file("tiny-sd15.ckpt").display().to_string();
    let st = common::fixture("single-file/tiny-sd15.safetensors");
    let want = common::cli::sample_bytes(dir.path(), st.to_str().unwrap(), "want.png", &[]);
    let o = sdtrain_cached(
        &common::cli::sample_args(&ckpt, "got.png"),
        dir.path(),
        &cache,
    );
    let log = common::cli::text(&o);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("read as data (nothing in it runs) and converted"),
        "{log}"
    );
    assert_eq!(std::fs::read(dir.path().join("got.png")).unwrap(), want);
    // The second run reuses the copy.
    let o = sdtrain_cached(
        &common::cli::sample_args(&ckpt, "again.png"),
        dir.path(),
        &cache,
    );
    let log = common::cli::text(&o);
    assert!(
        o.status.success() && log.contains("read through its converted copy"),
        "{log}"
    );
    assert_eq!(std::fs::read(dir.path().join("again.png")).unwrap(), want);
    let copies: Vec<_> = std::fs::read_dir(cache.join("converted"))
        .unwrap()
        .collect();
    assert_eq!(copies.len(), 1);
}

#[test]
fn convert_writes_a_torch_file_as_stored() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.safetensors");
    let o = common::cli::sdtrain(
        &[
            "convert",
            "--model",
            torch_file("tiny-sd15.ckpt").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        dir.path(),
    );
    let log = common::cli::text(&o);
    assert!(o.status.success(), "{log}");
    let got = safetensors_entries(&out);
    let want = safetensors_entries(&common::fixture("single-file/tiny-sd15.safetensors"));
    assert_eq!(got.len(), want.len());
    for (name, w) in &want {
        assert_eq!(&got[name], w, "{name}");
    }
    assert_eq!(
        common::cli::file_metadata(&out)
            .get("sdtrain.converted_from")
            .map(String::as_str),
        Some("tiny-sd15.ckpt")
    );
    assert!(!log.contains("left out"), "{log}");
}

#[test]
fn a_torch_file_that_is_not_a_model_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let legacy = common::fixture("torch-embeddings/legacy.pt");
    let o = sdtrain_cached(
        &common::cli::sample_args(legacy.to_str().unwrap(), "x.png"),
        dir.path(),
        &cache,
    );
    let log = common::cli::text(&o);
    assert_eq!(o.status.code(), Some(2), "{log}");
    // An embedding (in torch's legacy format) given as a model.
    assert!(
        log.contains("legacy.pt") && log.contains("not a full Stable Diffusion checkpoint"),
        "{log}"
    );
    let lightning = torch_file("lightning.ckpt");
    let o = sdtrain_cached(
        &common::cli::sample_args(lightning.to_str().unwrap(), "x.png"),
        dir.path(),
        &cache,
    );
    let log = common::cli::text(&o);
    assert!(!o.status.success(), "{log}");
    assert!(
        log.contains("not a full Stable Diffusion checkpoint"),
        "{log}"
    );
}

#[test]
fn an_a1111_vae_pt_is_read_as_its_safetensors_would_be() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let model = common::fixture("single-file/tiny-sd15.safetensors");
    let model = model.to_str().unwrap();
    let want = common::cli::sample_bytes(dir.path(), model, "want.png", &[]);
    let vae = torch_file("tiny-sd15-vae.pt");
    let mut args = common::cli::sample_args(model, "got.png");
    args.extend(["--vae", vae.to_str().unwrap()]);
    let o = sdtrain_cached(&args, dir.path(), &cache);
    let log = common::cli::text(&o);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("torch file read through its copy"), "{log}");
    // The file's VAE is the model's own: the same image, byte for byte.
    assert_eq!(std::fs::read(dir.path().join("got.png")).unwrap(), want);
}

#[test]
fn a_diffusers_folder_of_bin_weights_draws_what_its_safetensors_draw() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let want = common::cli::sample_bytes(
        dir.path(),
        common::fixture("tiny-sd15").to_str().unwrap(),
        "want.png",
        &[],
    );
    // tiny-sd15 with its UNet as one `.bin` and its text encoder as two `.bin` shards.
    let model = dir.path().join("old-model");
    common::copy_dir(&common::fixture("tiny-sd15"), &model);
    std::fs::remove_file(model.join("unet/diffusion_pytorch_model.safetensors")).unwrap();
    std::fs::remove_file(model.join("text_encoder/model.safetensors")).unwrap();
    common::copy_dir(&torch_file("tiny-sd15-bin"), &model);
    let o = sdtrain_cached(
        &common::cli::sample_args(model.to_str().unwrap(), "got.png"),
        dir.path(),
        &cache,
    );
    let log = common::cli::text(&o);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("unet: ") && log.contains("text_encoder: ") && log.contains("read as data"),
        "{log}"
    );
    assert_eq!(std::fs::read(dir.path().join("got.png")).unwrap(), want);
    // One copy per component, the two shards in one.
    assert_eq!(
        std::fs::read_dir(cache.join("converted")).unwrap().count(),
        2
    );
}

#[test]
fn a_re_zipped_checkpoint_with_deflated_entries_reads_the_same() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::File::open(torch_file("views.pt")).unwrap();
    let mut zin = zip::ZipArchive::new(src).unwrap();
    let path = dir.path().join("rezipped.pt");
    let mut zout = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
    let deflated = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for i in 0..zin.len() {
        let mut entry = zin.by_index(i).unwrap();
        let name = entry.name().unwrap().into_owned();
        let mut data = Vec::new();
        entry.read_to_end(&mut data).unwrap();
        zout.start_file(name, deflated).unwrap();
        zout.write_all(&data).unwrap();
    }
    zout.finish().unwrap();
    let (_, out) = converted(&path, dir.path());
    assert_eq!(
        safetensors_entries(&out),
        safetensors_entries(&torch_file("views.safetensors"))
    );
}

#[test]
fn a_lora_saved_as_pt_loads_as_its_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let st = common::fixture("kohya_tiny_sd15.safetensors");
    let pt = torch_file("kohya_tiny_sd15.pt");
    let model = common::fixture("tiny-sd15");
    let model = model.to_str().unwrap();
    let want = common::cli::sample_bytes(
        dir.path(),
        model,
        "want.png",
        &["--lora", st.to_str().unwrap()],
    );
    let got = common::cli::sample_bytes(
        dir.path(),
        model,
        "got.png",
        &["--lora", pt.to_str().unwrap()],
    );
    assert_eq!(got, want);
    // `inspect` reports it as the LoRA it is.
    let o = common::cli::sdtrain(&["inspect", "--model", pt.to_str().unwrap()], dir.path());
    let log = common::cli::text(&o);
    assert!(o.status.success(), "{log}");
    let o2 = common::cli::sdtrain(&["inspect", "--model", st.to_str().unwrap()], dir.path());
    let log2 = common::cli::text(&o2);
    let modules = |l: &str| l.lines().filter(|x| x.contains("modules")).count();
    assert!(
        modules(&log) > 0 && modules(&log) == modules(&log2),
        "{log}\n---\n{log2}"
    );
    // `resize-lora` gives the same tensors from either.
    let resized = |src: &Path, out: &str| {
        let out = dir.path().join(out);
        let o = common::cli::sdtrain(
            &[
                "resize-lora",
                "--lora",
                src.to_str().unwrap(),
                "--rank",
                "1",
                "--out",
                out.to_str().unwrap(),
            ],
            dir.path(),
        );
        assert!(o.status.success(), "{}", common::cli::text(&o));
        safetensors_entries(&out)
    };
    assert_eq!(resized(&pt, "a.safetensors"), resized(&st, "b.safetensors"));
}

/// A LONG1 opcode for a non-negative `v`.
fn long1(v: u64) -> Vec<u8> {
    let mut b = v.to_le_bytes().to_vec();
    while b.len() > 1 && b[b.len() - 1] == 0 && b[b.len() - 2] & 0x80 == 0 {
        b.pop();
    }
    if b[b.len() - 1] & 0x80 != 0 {
        b.push(0);
    }
    let mut out = vec![0x8a, b.len() as u8];
    out.extend(b);
    out
}

fn text(s: &str) -> Vec<u8> {
    let mut out = vec![b'X'];
    out.extend((s.len() as u32).to_le_bytes());
    out.extend(s.as_bytes());
    out
}

/// `torch.save({"w": t})` by hand, `t` a float32 view (`offset`, `size`, `stride`) of a storage
/// of `numel` elements, with `{"neg": True}` tensor metadata when `neg`.
fn hand_made_pt(path: &Path, numel: u64, offset: u64, size: &[u64], stride: &[u64], neg: bool) {
    use std::io::Write;
    let mut p = vec![0x80, 2, b'}'];
    p.extend(text("w"));
    p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(");
    p.push(b'(');
    p.extend(text("storage"));
    p.extend(b"ctorch\nFloatStorage\n");
    p.extend(text("0"));
    p.extend(text("cpu"));
    p.extend(long1(numel));
    p.extend([b't', b'Q']);
    p.extend(long1(offset));
    for dims in [size, stride] {
        p.push(b'(');
        for &d in dims {
            p.extend(long1(d));
        }
        p.push(b't');
    }
    p.push(0x89);
    p.extend(b"ccollections\nOrderedDict\n)R");
    if neg {
        p.push(b'}');
        p.extend(text("neg"));
        p.extend([0x88, b's']);
    }
    p.extend([b't', b'R', b's', b'.']);
    let mut z = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    z.start_file("archive/data.pkl", stored).unwrap();
    z.write_all(&p).unwrap();
    z.start_file("archive/data/0", stored).unwrap();
    z.write_all(&vec![0u8; 4 * numel as usize]).unwrap();
    z.finish().unwrap();
}

#[test]
fn hostile_views_are_refused_without_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("w.pt");
    let convert = |f: &Path| {
        torch_pickle::convert(f, &dir.path().join("o.safetensors"), Default::default())
            .map(|_| ())
            .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
    };
    // The hand-made file itself reads: a 2×2 view of a 4-element storage.
    hand_made_pt(&f, 4, 0, &[2, 2], &[2, 1], false);
    convert(&f).unwrap();
    for (what, offset, size, stride, neg, says) in [
        // A stride-0 view of one element as 2^40 of them: 4 TiB from 4 bytes.
        (
            "stride 0",
            0,
            vec![1u64 << 40],
            vec![0u64],
            false,
            "repeats elements",
        ),
        // An offset whose byte position overflows.
        (
            "offset",
            (1 << 62) - 1,
            vec![1],
            vec![1],
            false,
            "overflows",
        ),
        (
            "stride",
            0,
            vec![2, 1],
            vec![(1 << 63) - 1, 1],
            false,
            "overflows",
        ),
        ("past the end", 3, vec![2], vec![1], false, "reaches past"),
        // torch's negative bit: the values are to be read negated.
        ("neg bit", 0, vec![4], vec![1], true, "`neg` bit"),
    ] {
        hand_made_pt(&f, 1, offset, &size, &stride, neg);
        let err = convert(&f).expect_err(what);
        assert!(err.contains("w.pt") && err.contains(says), "{what}: {err}");
    }
}
