//! How the ranks of a data-parallel run build an in-memory latent cache (`cache_latents`) between
//! them: each encodes every `world`-th image, and the ranks then send each other what they
//! encoded, so that every rank holds every image's latents (any rank may train on any image) and
//! N cards encode the dataset N times faster.
//!
//! The entries go in rounds of at most [`ROUND_BYTES`] per rank, so that no collective carries
//! more than `world × ROUND_BYTES` however large the dataset. Each round's message is a list of
//! `(item index, length, entry)`, the entry in the disk cache's format
//! ([`super::latent_cache::entry_bytes`]); the rounds end when every rank sends nothing.

use std::path::Path;

use anyhow::{bail, Context};

use super::latent_cache::{entry_bytes, parse_entry, CachedLatent};
use crate::dist::Collective;

/// What one rank sends in one round, at most (a single entry larger than this goes alone).
pub const ROUND_BYTES: usize = 64 << 20;

/// The items of `n` this rank encodes: every `world`-th, from its rank.
pub fn share_of(n: usize, rank: usize, world: usize) -> Vec<usize> {
    (rank..n).step_by(world.max(1)).collect()
}

/// Sends `mine` (this rank's `(item, latents)`) to every rank and returns the other ranks'
/// entries, in rounds of at most `round_bytes` per rank. Every rank calls it at the same point.
pub fn exchange(
    coll: &mut dyn Collective,
    mine: &[(usize, CachedLatent)],
    round_bytes: usize,
) -> anyhow::Result<Vec<(usize, CachedLatent)>> {
    let rank = coll.rank();
    let mut next = 0;
    let mut received = Vec::new();
    // The entry that did not fit the last round, serialized once: it opens the next.
    let mut held: Option<Vec<u8>> = None;
    loop {
        let mut message = Vec::new();
        while let Some((item, latent)) = mine.get(next) {
            let entry = match held.take() {
                Some(e) => e,
                None => entry_bytes(&item.to_string(), latent)?,
            };
            if !message.is_empty() && message.len() + entry.len() + 16 > round_bytes {
                held = Some(entry);
                break;
            }
            message.extend_from_slice(&(*item as u64).to_le_bytes());
            message.extend_from_slice(&(entry.len() as u64).to_le_bytes());
            message.extend_from_slice(&entry);
            next += 1;
        }
        let parts = coll.all_gather("latent cache: entries", &message)?;
        if parts.iter().all(Vec::is_empty) {
            return Ok(received);
        }
        for (from, part) in parts.iter().enumerate().filter(|(r, _)| *r != rank) {
            received.extend(unpack(part).with_context(|| format!("rank {from}'s latents"))?);
        }
    }
}

/// The entries of one rank's message.
fn unpack(message: &[u8]) -> anyhow::Result<Vec<(usize, CachedLatent)>> {
    let word = |at: usize| -> anyhow::Result<u64> {
        let b = message
            .get(at..at + 8)
            .context("a message cut short in an entry's header")?;
        Ok(u64::from_le_bytes(b.try_into()?))
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < message.len() {
        let item = usize::try_from(word(at)?)?;
        let len = usize::try_from(word(at + 8)?)?;
        at += 16;
        let Some(bytes) = at.checked_add(len).and_then(|end| message.get(at..end)) else {
            bail!("item {item}'s entry is cut short ({len} bytes announced)");
        };
        let origin = format!("item {item}'s entry");
        let (latent, key) = parse_entry(bytes, Path::new(&origin))?;
        if key != item.to_string() {
            bail!("item {item}'s entry says it is item {key}");
        }
        out.push((item, latent));
        at += len;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TrainImage;
    use crate::dist::InProcess;
    use candle_core::{Device, Tensor};
    use std::path::PathBuf;
    use std::time::Duration;

    /// Item `i`'s latents: values and geometry that differ from item to item, a flip and a mask
    /// on every other one.
    fn latent(i: usize) -> CachedLatent {
        let (w, h) = (8 + 8 * (i % 3), 8);
        let moments = Tensor::arange(0f32, (8 * (h / 8) * (w / 8)) as f32, &Device::Cpu)
            .unwrap()
            .affine(1.0, i as f64 * 100.0)
            .unwrap()
            .reshape((8, h / 8, w / 8))
            .unwrap();
        CachedLatent {
            geometry: TrainImage {
                pixels: Vec::new(),
                width: w,
                height: h,
                original_size: (w + i, h + 2 * i),
                resized_size: (w, h + i),
                crop_top_left: (0, i),
                caption: String::new(),
                path: PathBuf::from(format!("img{i}.png")),
                multiplier: 1.0,
                options: Default::default(),
                mask: i
                    .is_multiple_of(2)
                    .then(|| (0..w * h).map(|k| (k + i) as u8).collect()),
            },
            flipped: (i % 2 == 1).then(|| moments.neg().unwrap()),
            moments,
        }
    }

    fn same(a: &CachedLatent, b: &CachedLatent) -> bool {
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (ga, gb) = (&a.geometry, &b.geometry);
        bits(&a.moments) == bits(&b.moments)
            && a.flipped.as_ref().map(bits) == b.flipped.as_ref().map(bits)
            && a.moments.dims() == b.moments.dims()
            && (ga.width, ga.height, ga.original_size, ga.resized_size)
                == (gb.width, gb.height, gb.original_size, gb.resized_size)
            && (ga.crop_top_left, &ga.path, &ga.mask) == (gb.crop_top_left, &gb.path, &gb.mask)
    }

    /// 3 ranks share 8 items (3, 3 and 2 each) with rounds of about two entries: every rank ends
    /// with every other rank's entries, whole and once. Catches a last round left unsent, an
    /// entry dropped at a round's edge, a rank's own entries sent back to it, and a share that
    /// skips or repeats items.
    #[test]
    fn every_rank_ends_with_every_entry_over_several_rounds() {
        let n = 8;
        let round = 2 * entry_bytes("0", &latent(0)).unwrap().len() + 40;
        let links = InProcess::group(3, Duration::from_secs(20));
        let got: Vec<Vec<(usize, CachedLatent)>> = std::thread::scope(|s| {
            let handles: Vec<_> = links
                .into_iter()
                .map(|mut l| {
                    s.spawn(move || {
                        let (rank, world) = (l.rank(), l.world());
                        let mine: Vec<(usize, CachedLatent)> = share_of(n, rank, world)
                            .into_iter()
                            .map(|i| (i, latent(i)))
                            .collect();
                        let others = exchange(&mut l, &mine, round).unwrap();
                        mine.into_iter().chain(others).collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, mut all) in got.into_iter().enumerate() {
            all.sort_by_key(|(i, _)| *i);
            let items: Vec<usize> = all.iter().map(|(i, _)| *i).collect();
            assert_eq!(items, (0..n).collect::<Vec<_>>(), "rank {rank}");
            for (i, l) in &all {
                assert!(same(l, &latent(*i)), "rank {rank}, item {i}");
            }
        }
    }

    #[test]
    fn shares_cover_every_item_once() {
        for (n, world) in [(0, 2), (1, 3), (7, 3), (8, 4), (5, 1)] {
            let mut all: Vec<usize> = (0..world).flat_map(|r| share_of(n, r, world)).collect();
            all.sort();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "{n} items, {world} ranks");
        }
    }

    #[test]
    fn a_damaged_message_is_an_error_naming_the_item() {
        let entry = entry_bytes("4", &latent(4)).unwrap();
        let mut message = 4u64.to_le_bytes().to_vec();
        message.extend_from_slice(&(entry.len() as u64).to_le_bytes());
        message.extend_from_slice(&entry[..entry.len() - 3]);
        let e = unpack(&message).unwrap_err().to_string();
        assert!(e.contains("item 4's entry is cut short"), "{e}");
        let mut message = 5u64.to_le_bytes().to_vec();
        message.extend_from_slice(&(entry.len() as u64).to_le_bytes());
        message.extend_from_slice(&entry);
        let e = unpack(&message).unwrap_err().to_string();
        assert!(e.contains("item 5's entry says it is item 4"), "{e}");
    }
}
