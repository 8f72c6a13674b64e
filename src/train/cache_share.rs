//! How the ranks of a data-parallel run split the encoding of a disk latent cache
//! (`cache_latents_to_disk`): the ranks that see the same cache folder (one machine, or a shared
//! filesystem) each encode an equal share of the entries it lacks, then wait for each other, so
//! N cards build the cache N times faster instead of each encoding every image. A rank that sees
//! no other rank's files (another machine's disk) has a share of one: it encodes all it lacks.
//!
//! Which ranks share the folder is found, not assumed: each rank writes a probe file named by a
//! nonce from rank 0 and its own rank, all wait, and each lists the probes it sees. Two ranks
//! share the folder when each sees the other's probe.

use std::path::{Path, PathBuf};

use crate::dist::Collective;

/// This rank's place among the ranks that share the cache folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Its index among them, in rank order.
    pub position: usize,
    /// How many they are (1: this rank alone).
    pub members: usize,
}

impl Shard {
    /// The entries of `missing` this rank encodes: every `members`-th from its position.
    pub fn take(&self, missing: &[usize]) -> Vec<usize> {
        missing
            .iter()
            .enumerate()
            .filter(|(j, _)| j % self.members == self.position)
            .map(|(_, &i)| i)
            .collect()
    }
}

fn probe_path(dir: &Path, nonce: u64, rank: usize) -> PathBuf {
    dir.join(format!(".share-probe-{nonce:016x}-{rank}"))
}

/// Finds the ranks that see `dir` as this rank does (every rank calls it, at the same point).
pub fn shard_for(dir: &Path, coll: &mut dyn Collective) -> anyhow::Result<Shard> {
    let (rank, world) = (coll.rank(), coll.world());
    // A nonce from rank 0, so that probes of an earlier run that died are never counted.
    let mine = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ u64::from(std::process::id()).rotate_left(32);
    let bytes = coll.broadcast(&mine.to_le_bytes())?;
    let nonce = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| anyhow::anyhow!("latent cache: rank 0's nonce is {} bytes", bytes.len()))?;
    let probe = probe_path(dir, nonce, rank);
    // A probe that cannot be written leaves this rank alone (it still takes part in the votes).
    let wrote = std::fs::write(&probe, []).is_ok();
    coll.all_gather("latent cache: probes written", &[])?;
    let seen: Vec<u8> = (0..world)
        .map(|r| u8::from(probe_path(dir, nonce, r).exists()))
        .collect();
    let all = coll.all_gather("latent cache: probes seen", &seen)?;
    if wrote {
        let _ = std::fs::remove_file(&probe);
    }
    let sees = |a: usize, b: usize| all.get(a).and_then(|s| s.get(b)).is_some_and(|&v| v != 0);
    let group: Vec<usize> = (0..world)
        .filter(|&r| r == rank || (sees(rank, r) && sees(r, rank)))
        .collect();
    let position = group.iter().position(|&r| r == rank).unwrap_or(0);
    Ok(Shard {
        position,
        members: group.len().max(1),
    })
}

/// Waits for every rank to finish its share; `ok` is whether this one did. A rank whose share
/// failed ends the build on every rank (it returns its own error; the others name it).
pub fn wait_for_shares(coll: &mut dyn Collective, ok: bool) -> anyhow::Result<()> {
    let all = coll.all_gather("latent cache: shares written", &[u8::from(ok)])?;
    if let Some(r) = (0..all.len()).find(|&r| all[r].first() != Some(&1) && r != coll.rank()) {
        anyhow::bail!("rank {r} could not encode its share of the latent cache (see its error)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::InProcess;
    use std::time::Duration;

    /// Runs `f` on each rank of an in-process group of `world`, returning the results in rank
    /// order (an error if a rank's thread panicked).
    fn on_ranks<T: Send>(
        world: usize,
        f: impl Fn(&mut dyn Collective) -> T + Sync,
    ) -> std::thread::Result<Vec<T>> {
        let links = InProcess::group(world, Duration::from_secs(20));
        std::thread::scope(|s| {
            let handles: Vec<_> = links
                .into_iter()
                .map(|mut l| {
                    let f = &f;
                    s.spawn(move || f(&mut l))
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect()
        })
    }

    #[test]
    fn ranks_sharing_a_folder_split_the_missing_entries() {
        let dir = tempfile::tempdir().unwrap();
        let shards = on_ranks(3, |c| shard_for(dir.path(), c).unwrap()).unwrap();
        let missing: Vec<usize> = (10..20).collect();
        let mut all: Vec<usize> = Vec::new();
        for (r, s) in shards.iter().enumerate() {
            assert_eq!(
                *s,
                Shard {
                    position: r,
                    members: 3
                }
            );
            all.extend(s.take(&missing));
        }
        all.sort();
        assert_eq!(all, missing, "every entry once");
        // The probes are gone.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn ranks_on_separate_folders_each_take_everything() {
        let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
        let paths: Vec<PathBuf> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
        let shards = on_ranks(2, |c| {
            let r = c.rank();
            shard_for(&paths[r], c).unwrap()
        })
        .unwrap();
        for s in shards {
            assert_eq!(
                s,
                Shard {
                    position: 0,
                    members: 1
                }
            );
            assert_eq!(s.take(&[4, 5, 6]), [4, 5, 6]);
        }
    }

    #[test]
    fn a_failed_share_ends_the_build_on_every_rank() {
        let results = on_ranks(2, |c| {
            let ok = c.rank() == 0;
            wait_for_shares(c, ok).map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!(
            results[0].as_ref().unwrap_err(),
            "rank 1 could not encode its share of the latent cache (see its error)"
        );
        // Rank 1 returns its own error to its caller; the vote itself succeeds there.
        assert!(results[1].is_ok());
        let results = on_ranks(2, |c| wait_for_shares(c, true).is_ok()).unwrap();
        assert_eq!(results, [true, true]);
    }
}
