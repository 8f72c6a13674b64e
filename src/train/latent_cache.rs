//! The latent cache (`cache_latents`, `cache_latents_to_disk`): each image's VAE posterior,
//! computed once before training, so the VAE leaves the device for the rest of the run.
//!
//! - What is kept is the posterior's moments (mean and log-variance, `[2·latent, h, w]` f32) of
//!   the centre crop at the image's bucket, and of its mirror image when `flip_p > 0` (kohya's
//!   `flip_aug` caches both the same way). The posterior is still sampled at every step, with
//!   the same seeded draws as without a cache, so a cached run trains on what an uncached one
//!   would (to the rounding of encoding images one batch or another).
//! - On disk, each image is one safetensors file in `<output_dir>/latent_cache/`, shared by the
//!   runs of that folder. Its name is a hash of the key: the image file's content (SHA-256),
//!   the bucket, the crop, whether the flip is included, the VAE's identity (a SHA-256 of its
//!   weight files and config, and the dtype it encodes in) and, with masked loss on, the mask's
//!   source and content (the cropped mask is kept in the entry, `[h, w]` u8). A changed image, bucket or VAE makes
//!   another name, so nothing stale is served; the file also stores the key, checked on load.
//!   Files are written to a temporary name and renamed. The cache's files are read back one step
//!   at a time, so memory holds a few steps of latents, not the dataset.
//! - In memory, the moments of every image stay in host RAM: `2·4·(h/8)·(w/8)` f32 per image and
//!   variant, 128 KiB at 512² (256 KiB with the flip).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::{cache_share, latent_exchange};
use crate::data::mask::MaskSource;
use crate::data::{augment, load_with_mask, Bucket, ImageMeta, ItemOptions, TrainImage};
use crate::dist::Collective;
use crate::error_chain::External;
use crate::model::files::ComponentSource;
use crate::model::pipeline::StableDiffusion;

/// The folder under `output_dir` that holds cached latents.
pub const CACHE_DIR: &str = "latent_cache";

/// Bumped when what a file holds changes meaning.
const FORMAT: &str = "sdtrain-latents-v1";

/// One image's cached posterior and what the step needs besides it.
#[derive(Debug, Clone)]
pub struct CachedLatent {
    /// Caption, sizes and crop of the image as trained (its `pixels` are empty).
    pub geometry: TrainImage,
    /// `[2·latent, h, w]` f32 on the host.
    pub moments: Tensor,
    /// The mirror image's, when flips are on.
    pub flipped: Option<Tensor>,
}

impl CachedLatent {
    /// The moments and geometry of the sample as drawn: mirrored when `flip`.
    pub fn variant(&self, flip: bool) -> anyhow::Result<(Tensor, TrainImage)> {
        if !flip {
            return Ok((self.moments.clone(), self.geometry.clone()));
        }
        match &self.flipped {
            Some(m) => Ok((m.clone(), augment::hflip(&self.geometry))),
            None => bail!(
                "{}: the latent cache holds no flipped latents (flip_p was 0 when it was built)",
                self.geometry.path.display()
            ),
        }
    }
}

/// Where the cached latents are.
pub enum LatentStore {
    Memory(Vec<Arc<CachedLatent>>),
    /// One file per item, and the item's caption and settings.
    Disk(Vec<(PathBuf, String, Arc<ItemOptions>)>),
}

impl LatentStore {
    /// Item `i`'s latents (read from disk for a disk cache).
    pub fn get(&self, i: usize) -> anyhow::Result<Arc<CachedLatent>> {
        match self {
            Self::Memory(v) => v
                .get(i)
                .cloned()
                .with_context(|| format!("no cached latents for item {i}")),
            Self::Disk(files) => {
                let (path, caption, options) = files
                    .get(i)
                    .with_context(|| format!("no cached latents for item {i}"))?;
                let (mut latent, _) = read_entry(path)?;
                latent.geometry.caption = caption.clone();
                latent.geometry.options = options.clone();
                Ok(Arc::new(latent))
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Memory(v) => v.len(),
            Self::Disk(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An entry read back (from disk or another rank) with its item's caption and settings, which
/// the entry does not hold.
fn with_item(mut latent: CachedLatent, item: &ImageMeta) -> CachedLatent {
    latent.geometry.caption.clone_from(&item.caption);
    latent.geometry.multiplier = item.multiplier;
    latent.geometry.options = item.options.clone();
    latent
}

/// What building a cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Entries this rank encoded.
    pub encoded: usize,
    /// Entries already on disk from an earlier run.
    pub reused: usize,
    /// Entries the other ranks sharing the folder encoded (data parallel).
    pub by_others: usize,
}

/// How to build a cache.
pub struct CacheSpec<'a> {
    pub items: &'a [ImageMeta],
    pub buckets: &'a [Bucket],
    /// Also cache the mirror images.
    pub with_flip: bool,
    /// `Some(folder)` for a disk cache.
    pub dir: Option<PathBuf>,
    pub max_pixels: u64,
    /// Images encoded per VAE call.
    pub batch: usize,
    /// Where the loss masks come from, when masked loss is on: each entry keeps its image's
    /// cropped mask (the flipped variant mirrors it).
    pub masks: Option<MaskSource>,
}

/// The VAE's identity for cache keys: a SHA-256 of its config and weight files, and the dtype
/// it encodes in.
pub fn vae_identity(sd: &StableDiffusion) -> anyhow::Result<String> {
    let files = sd
        .layout
        .component(crate::model::files::Component::Vae)
        .context("the model has no VAE")?;
    let mut h = Sha256::new();
    match &files.source {
        ComponentSource::Folder {
            config, weights, ..
        } => {
            for path in std::iter::once(config).chain(weights) {
                hash_file(&mut h, path)?;
            }
        }
        ComponentSource::Packed { packed, .. } => {
            // A single file: the VAE's config and its tensors' stored bytes, not the whole file.
            h.update(packed.config.to_string().as_bytes());
            for (name, _) in packed.view.entries() {
                h.update(name.as_bytes());
                h.update(packed.view.stored_bytes(name).unwrap_or_default());
            }
        }
    }
    let dtype = sd.vae()?.dtype();
    Ok(format!("{}-{dtype:?}", hex(&h.finalize())))
}

fn hash_file(h: &mut Sha256, path: &Path) -> anyhow::Result<()> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            return Ok(());
        }
        h.update(&buf[..n]);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache key of one image: see the module header. With masks on, the key also names the
/// mask's source and, for a mask file, its content (or its absence), so an entry made without
/// masks, or with another mask, is not served.
pub fn entry_key(
    image: &Path,
    bucket: Bucket,
    with_flip: bool,
    vae_id: &str,
    masks: Option<MaskSource>,
) -> anyhow::Result<String> {
    let mut h = Sha256::new();
    hash_file(&mut h, image)?;
    let mask = match masks {
        None => String::new(),
        Some(MaskSource::Alpha) => "|mask alpha".to_string(),
        Some(MaskSource::File) => {
            let path = crate::data::mask::mask_path(image);
            if path.is_file() {
                let mut m = Sha256::new();
                hash_file(&mut m, &path)?;
                format!("|mask file {}", hex(&m.finalize()))
            } else {
                "|mask file none".to_string()
            }
        }
    };
    Ok(format!(
        "{FORMAT}|image {}|bucket {bucket}|crop centre|flip {with_flip}|vae {vae_id}{mask}",
        hex(&h.finalize())
    ))
}

/// The file of `key` in `dir`.
pub fn entry_path(dir: &Path, key: &str) -> PathBuf {
    let name = hex(&Sha256::digest(key.as_bytes())[..16]);
    dir.join(format!("{name}.safetensors"))
}

/// Encodes (or, on disk, finds) every item's latents with `sd`'s VAE.
///
/// `share`: the ranks of a data-parallel run (every rank calls `build` at the same point). For a
/// disk cache, the ranks that see the same folder split the missing entries among themselves
/// ([`super::cache_share`]); an in-memory cache is built whole on each rank.
pub fn build(
    sd: &StableDiffusion,
    spec: &CacheSpec<'_>,
    device: &Device,
    share: Option<&mut dyn Collective>,
) -> anyhow::Result<(LatentStore, CacheStats)> {
    let mut stats = CacheStats::default();
    match &spec.dir {
        None => {
            let n = spec.items.len();
            let mut encoded = match share.filter(|c| c.world() > 1) {
                None => {
                    let all: Vec<usize> = (0..n).collect();
                    let encoded = encode_items(sd, spec, &all, device)?;
                    stats.encoded = encoded.len();
                    encoded
                }
                Some(coll) => {
                    let mine = latent_exchange::share_of(n, coll.rank(), coll.world());
                    let done = encode_items(sd, spec, &mine, device);
                    cache_share::wait_for_shares(coll, done.is_ok())?;
                    let mut encoded = done?;
                    stats.encoded = encoded.len();
                    let others =
                        latent_exchange::exchange(coll, &encoded, latent_exchange::ROUND_BYTES)?;
                    stats.by_others = others.len();
                    // The entries carry the geometry; the caption and settings are the items'.
                    for (i, latent) in others {
                        let item = spec.items.get(i).with_context(|| {
                            format!("another rank sent latents for item {i} of {n}")
                        })?;
                        encoded.push((i, with_item(latent, item)));
                    }
                    encoded
                }
            };
            encoded.sort_by_key(|(i, _)| *i);
            if encoded.len() != n || encoded.iter().enumerate().any(|(k, (i, _))| k != *i) {
                bail!(
                    "the latent cache holds {} entries for {n} images",
                    encoded.len()
                );
            }
            let store = encoded.into_iter().map(|(_, l)| Arc::new(l)).collect();
            Ok((LatentStore::Memory(store), stats))
        }
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let vae_id = vae_identity(sd)?;
            let keys: Vec<anyhow::Result<(String, PathBuf)>> = spec
                .items
                .par_iter()
                .zip(spec.buckets.par_iter())
                .map(|(item, &bucket)| {
                    let key = entry_key(&item.path, bucket, spec.with_flip, &vae_id, spec.masks)?;
                    let path = entry_path(dir, &key);
                    Ok((key, path))
                })
                .collect();
            let keys = keys.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
            let missing: Vec<usize> = (0..keys.len())
                .filter(|&i| !entry_is_valid(&keys[i].1, &keys[i].0))
                .collect();
            stats.reused = keys.len() - missing.len();
            let write = |which: &[usize]| -> anyhow::Result<usize> {
                let encoded = encode_items(sd, spec, which, device)?;
                for (i, latent) in &encoded {
                    write_entry(&keys[*i].1, &keys[*i].0, latent)?;
                }
                Ok(encoded.len())
            };
            match share.filter(|c| c.world() > 1) {
                None => stats.encoded = write(&missing)?,
                Some(coll) => {
                    let mine = cache_share::shard_for(dir, coll)?.take(&missing);
                    let done = write(&mine);
                    cache_share::wait_for_shares(coll, done.is_ok())?;
                    stats.encoded = done?;
                    // Entries no other rank wrote here (none when the folder is shared).
                    let left: Vec<usize> = missing
                        .iter()
                        .copied()
                        .filter(|&i| !entry_is_valid(&keys[i].1, &keys[i].0))
                        .collect();
                    stats.encoded += write(&left)?;
                    stats.by_others = missing.len().saturating_sub(mine.len() + left.len());
                }
            }
            let files = keys
                .into_iter()
                .zip(spec.items)
                .map(|((_, path), item)| (path, item.caption.clone(), item.options.clone()))
                .collect();
            Ok((LatentStore::Disk(files), stats))
        }
    }
}

/// Encodes `which` items, a bucket at a time in batches of `spec.batch`, decoding each batch's
/// images in parallel. Returns `(item, latents)` in no particular order.
fn encode_items(
    sd: &StableDiffusion,
    spec: &CacheSpec<'_>,
    which: &[usize],
    device: &Device,
) -> anyhow::Result<Vec<(usize, CachedLatent)>> {
    let mut by_bucket: HashMap<Bucket, Vec<usize>> = HashMap::new();
    for &i in which {
        by_bucket.entry(spec.buckets[i]).or_default().push(i);
    }
    let mut groups: Vec<(Bucket, Vec<usize>)> = by_bucket.into_iter().collect();
    groups.sort_by_key(|(b, _)| *b);
    let vae = sd.vae()?;
    let mut out = Vec::with_capacity(which.len());
    for (bucket, ids) in groups {
        for chunk in ids.chunks(spec.batch.max(1)) {
            let images: Vec<TrainImage> = chunk
                .par_iter()
                .map(|&i| {
                    let item = &spec.items[i];
                    // The centre crop: no draws.
                    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(0);
                    let target = (bucket.width, bucket.height);
                    let mut im = load_with_mask(
                        &item.path,
                        target,
                        0.0,
                        &mut rng,
                        spec.max_pixels,
                        spec.masks,
                    )?;
                    im.caption = item.caption.clone();
                    im.multiplier = item.multiplier;
                    im.options = item.options.clone();
                    Ok(im)
                })
                .collect::<Result<_, crate::data::DataError>>()?;
            let refs: Vec<&TrainImage> = images.iter().collect();
            let moments = encode(vae, &refs, device)?;
            let flipped = if spec.with_flip {
                let mirrored: Vec<TrainImage> = images.iter().map(augment::hflip).collect();
                let refs: Vec<&TrainImage> = mirrored.iter().collect();
                Some(encode(vae, &refs, device)?)
            } else {
                None
            };
            for (k, (&i, mut geometry)) in chunk.iter().zip(images).enumerate() {
                geometry.pixels = Vec::new();
                out.push((
                    i,
                    CachedLatent {
                        geometry,
                        moments: moments.get(k)?,
                        flipped: flipped.as_ref().map(|f| f.get(k)).transpose()?,
                    },
                ));
            }
        }
    }
    Ok(out)
}

/// The moments of `images` as f32 on the host.
fn encode(
    vae: &crate::model::vae::AutoencoderKL,
    images: &[&TrainImage],
    device: &Device,
) -> anyhow::Result<Tensor> {
    let x = augment::to_tensor(images, device)?.to_dtype(vae.dtype())?;
    Ok(vae
        .encode_moments(&x)?
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?)
}

fn entry_is_valid(path: &Path, key: &str) -> bool {
    matches!(read_entry(path), Ok((_, stored)) if stored == key)
}

/// One entry as the bytes of a safetensors file: the moments, the flipped ones and the mask, with
/// the key and the geometry as metadata.
pub(super) fn entry_bytes(key: &str, latent: &CachedLatent) -> anyhow::Result<Vec<u8>> {
    let g = &latent.geometry;
    let pair = |(a, b): (usize, usize)| format!("{a},{b}");
    let metadata: HashMap<String, String> = [
        ("key", key.to_string()),
        ("path", g.path.display().to_string()),
        ("size", pair((g.width, g.height))),
        ("original_size", pair(g.original_size)),
        ("resized_size", pair(g.resized_size)),
        ("crop_top_left", pair(g.crop_top_left)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let f32_bytes = |t: &Tensor| -> anyhow::Result<(Vec<usize>, Vec<u8>)> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((
            t.dims().to_vec(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ))
    };
    let mut data: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let (shape, bytes) = f32_bytes(&latent.moments)?;
    data.push(("moments", safetensors::Dtype::F32, shape, bytes));
    if let Some(f) = &latent.flipped {
        let (shape, bytes) = f32_bytes(f)?;
        data.push(("moments_flipped", safetensors::Dtype::F32, shape, bytes));
    }
    if let Some(m) = &g.mask {
        data.push((
            "mask",
            safetensors::Dtype::U8,
            vec![g.height, g.width],
            m.clone(),
        ));
    }
    let views = data
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map_err(External)
                .with_context(|| format!("{}: latent cache tensor {name}", g.path.display()))?;
            Ok((name.to_string(), view))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    safetensors::serialize(views, Some(metadata))
        .map_err(External)
        .with_context(|| format!("{}: writing its latent cache entry", g.path.display()))
}

/// Writes one entry ([`entry_bytes`]) to `path`.
fn write_entry(path: &Path, key: &str, latent: &CachedLatent) -> anyhow::Result<()> {
    let bytes = entry_bytes(key, latent)?;
    // Several writers (data-parallel ranks, runs sharing the folder) may write the same entry at
    // once: each writes a temporary file of its own, and each rename puts a whole file in place.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("safetensors.{}-{n}.partial", std::process::id()));
    let written = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}

/// Reads one entry and the key it was written for.
fn read_entry(path: &Path) -> anyhow::Result<(CachedLatent, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_entry(&bytes, path)
}

/// An entry from its bytes ([`entry_bytes`]) and the key it was written for; `path` names where
/// the bytes came from in errors.
pub(super) fn parse_entry(bytes: &[u8], path: &Path) -> anyhow::Result<(CachedLatent, String)> {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(External)
        .with_context(|| format!("{} is not a latent cache file", path.display()))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let field = |k: &str| -> anyhow::Result<String> {
        meta.get(k)
            .cloned()
            .with_context(|| format!("{}: no `{k}` in its metadata", path.display()))
    };
    let pair = |k: &str| -> anyhow::Result<(usize, usize)> {
        let v = field(k)?;
        let parsed = v
            .split_once(',')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
        parsed.with_context(|| format!("{}: bad `{k}` {v:?}", path.display()))
    };
    let tensors = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
        .map_err(External)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let moments = tensors
        .get("moments")
        .cloned()
        .with_context(|| format!("{}: no `moments` tensor", path.display()))?;
    let (width, height) = pair("size")?;
    let mask = match tensors.get("mask") {
        Some(m) if m.dims() == [height, width] && m.dtype() == DType::U8 => {
            Some(m.flatten_all()?.to_vec1::<u8>()?)
        }
        Some(m) => bail!(
            "{}: its mask is {:?} {:?}, not {height}×{width} u8",
            path.display(),
            m.dtype(),
            m.dims()
        ),
        None => None,
    };
    let geometry = TrainImage {
        pixels: Vec::new(),
        width,
        height,
        original_size: pair("original_size")?,
        resized_size: pair("resized_size")?,
        crop_top_left: pair("crop_top_left")?,
        caption: String::new(),
        path: PathBuf::from(field("path")?),
        multiplier: 1.0,
        options: Default::default(),
        mask,
    };
    let latent = CachedLatent {
        geometry,
        moments,
        flipped: tensors.get("moments_flipped").cloned(),
    };
    Ok((latent, field("key")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn latent(path: &str) -> CachedLatent {
        CachedLatent {
            geometry: TrainImage {
                pixels: Vec::new(),
                width: 16,
                height: 8,
                original_size: (30, 50),
                resized_size: (8, 13),
                crop_top_left: (0, 2),
                caption: "c".into(),
                path: PathBuf::from(path),
                multiplier: 1.0,
                options: Default::default(),
                mask: Some((0..128).collect()),
            },
            moments: Tensor::arange(0f32, 8.0 * 4.0, &Device::Cpu)
                .unwrap()
                .reshape((8, 2, 2))
                .unwrap(),
            flipped: Some(Tensor::zeros((8, 2, 2), DType::F32, &Device::Cpu).unwrap()),
        }
    }

    #[test]
    fn an_entry_round_trips_with_its_key_and_geometry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.safetensors");
        let l = latent("img.png");
        write_entry(&path, "k1", &l).unwrap();
        assert!(entry_is_valid(&path, "k1"));
        assert!(!entry_is_valid(&path, "k2"));
        let (back, key) = read_entry(&path).unwrap();
        assert_eq!(key, "k1");
        assert_eq!(back.geometry.original_size, (30, 50));
        assert_eq!(back.geometry.crop_top_left, (0, 2));
        let a: Vec<f32> = back.moments.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = l.moments.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a, b);
        // the flipped variant mirrors the crop
        assert_eq!(back.geometry.mask, l.geometry.mask);
        let (_, g) = back.variant(true).unwrap();
        assert_eq!(g.crop_top_left, (0, 0)); // 13 − 2 − 16, saturated
                                             // and mirrors the mask: row 0 of the 16-wide mask is 0..16, reversed
        assert_eq!(
            g.mask.as_ref().unwrap()[..16],
            (0..16).rev().collect::<Vec<u8>>()
        );
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "a temporary file was left behind");
    }

    /// Data-parallel ranks on one machine build the same disk cache at once: writers of the same
    /// entry never see each other's temporary file, and what is left is one whole entry. With a
    /// shared temporary name, a rename moves the file another writer still writes, which then
    /// fails to find it.
    #[test]
    fn concurrent_writers_of_one_entry_leave_a_whole_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.safetensors");
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let l = latent("img.png");
                    for _ in 0..10 {
                        write_entry(&path, "k1", &l).unwrap();
                    }
                });
            }
        });
        assert!(entry_is_valid(&path, "k1"));
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1);
    }

    #[test]
    fn a_truncated_entry_is_not_valid() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.safetensors");
        write_entry(&path, "k", &latent("a.png")).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        assert!(!entry_is_valid(&path, "k"));
        assert!(!entry_is_valid(&dir.path().join("absent.safetensors"), "k"));
    }

    #[test]
    fn the_key_changes_with_image_bucket_flip_and_vae() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("a.png");
        std::fs::write(&img, b"first").unwrap();
        let b = Bucket::new(64, 64);
        let key = |b, flip, vae: &str| entry_key(&img, b, flip, vae, None).unwrap();
        let k = key(b, false, "vae1");
        assert_eq!(k, key(b, false, "vae1"));
        assert_ne!(k, key(Bucket::new(72, 56), false, "vae1"));
        assert_ne!(k, key(b, true, "vae1"));
        assert_ne!(k, key(b, false, "vae2"));
        // masks on: another key, which follows the mask file's content
        let masked = |m| entry_key(&img, b, false, "vae1", Some(m)).unwrap();
        let (none, alpha) = (masked(MaskSource::File), masked(MaskSource::Alpha));
        assert!(k != none && k != alpha && none != alpha);
        std::fs::write(dir.path().join("a-masklabel.png"), b"m1").unwrap();
        let m1 = masked(MaskSource::File);
        std::fs::write(dir.path().join("a-masklabel.png"), b"m2").unwrap();
        assert!(m1 != none && m1 != masked(MaskSource::File));
        std::fs::write(&img, b"second").unwrap();
        assert_ne!(k, key(b, false, "vae1"));
        assert_ne!(entry_path(dir.path(), "x"), entry_path(dir.path(), "y"));
    }
}
