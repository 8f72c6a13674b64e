//! Ranks as processes, on one machine or several, joined over TCP through the environment
//! torchrun sets ([`DistEnv`]). Rank 0 listens on `MASTER_PORT`; every other rank connects to
//! `MASTER_ADDR:MASTER_PORT`, and the group is a star: each collective sends every rank's bytes
//! to rank 0, which sends all of them back. It carries the CPU path's gradients and, on cards,
//! the small messages around NCCL (its unique id, the out-of-memory vote).
//!
//! Rank 0 waits `timeout` for each rank; the others wait twice that for rank 0, so that when a
//! rank dies or stalls, rank 0 sees it first and tells the survivors which rank it was before
//! closing. After any error the group is broken: every later call fails at once.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{Collective, DistEnv, DistError};

const MAGIC: &[u8; 8] = b"sdtrain1";
/// The op name of an error frame: rank 0 telling the others why the run ends.
const ERROR_OP: &str = "!error";

/// One rank of a TCP group.
pub struct Tcp {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Rank 0: the stream of every other rank (index = rank; 0 is `None`). Others: rank 0's
    /// stream at index 0.
    links: Vec<Option<TcpStream>>,
    broken: Option<String>,
}

fn io_error(op: &'static str, rank: usize, e: std::io::Error, timeout: Duration) -> DistError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => DistError::Timeout {
            op,
            missing: vec![rank],
            timeout,
        },
        _ => DistError::RankLost {
            op,
            rank,
            why: e.to_string(),
        },
    }
}

fn write_frame(s: &mut TcpStream, op: &str, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(payload.len() + op.len() + 9);
    buf.push(op.len() as u8);
    buf.extend_from_slice(op.as_bytes());
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(String, Vec<u8>)> {
    let mut len = [0u8; 1];
    s.read_exact(&mut len)?;
    let mut op = vec![0u8; usize::from(len[0])];
    s.read_exact(&mut op)?;
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let n = usize::try_from(u64::from_le_bytes(n))
        .map_err(|_| std::io::Error::new(ErrorKind::InvalidData, "frame too large"))?;
    let mut payload = vec![0u8; n];
    s.read_exact(&mut payload)?;
    Ok((String::from_utf8_lossy(&op).into_owned(), payload))
}

fn rendezvous(env: &DistEnv, why: impl std::fmt::Display) -> DistError {
    DistError::Rendezvous {
        addr: env.master(),
        why: why.to_string(),
    }
}

impl Tcp {
    /// Joins the group `env` describes; returns once every rank has joined, or fails after
    /// `timeout` naming the ranks that did not.
    pub fn join(env: &DistEnv, timeout: Duration) -> Result<Self, DistError> {
        let mut me = Self {
            rank: env.rank,
            world: env.world_size,
            timeout,
            links: (0..env.world_size).map(|_| None).collect(),
            broken: None,
        };
        if env.rank == 0 {
            me.accept_all(env)?;
        } else {
            me.connect(env)?;
        }
        Ok(me)
    }

    fn accept_all(&mut self, env: &DistEnv) -> Result<(), DistError> {
        let listener = TcpListener::bind(("0.0.0.0", env.master_port))
            .map_err(|e| rendezvous(env, format!("rank 0 cannot listen: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| rendezvous(env, e))?;
        let deadline = Instant::now() + self.timeout;
        while self.links.iter().skip(1).any(Option::is_none) {
            match listener.accept() {
                Ok((s, _)) => self.greet(env, s)?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing = (1..self.world).filter(|r| self.links[*r].is_none());
                        let missing: Vec<usize> = missing.collect();
                        self.fail_all(&format!("ranks {missing:?} never joined"));
                        return Err(DistError::Timeout {
                            op: "join",
                            missing,
                            timeout: self.timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(rendezvous(env, e)),
            }
        }
        for r in 1..self.world {
            if let Some(s) = self.links[r].as_mut() {
                write_frame(s, "ready", &[]).map_err(|e| io_error("join", r, e, self.timeout))?;
            }
        }
        Ok(())
    }

    /// Reads a joining rank's greeting and keeps its stream.
    fn greet(&mut self, env: &DistEnv, mut s: TcpStream) -> Result<(), DistError> {
        self.configure(&s, self.timeout)
            .map_err(|e| rendezvous(env, e))?;
        let (op, hello) = read_frame(&mut s).map_err(|e| rendezvous(env, e))?;
        if op != "hello" || hello.len() != 24 || &hello[..8] != MAGIC {
            return Err(rendezvous(env, "a connection that is not an sdtrain rank"));
        }
        let word = |i: usize| u64::from_le_bytes(hello[i..i + 8].try_into().unwrap_or_default());
        let (rank, world) = (word(8) as usize, word(16) as usize);
        if world != self.world || rank == 0 || rank >= self.world || self.links[rank].is_some() {
            return Err(rendezvous(
                env,
                format!(
                    "a rank says it is {rank} of {world}; this run has {}",
                    self.world
                ),
            ));
        }
        self.links[rank] = Some(s);
        Ok(())
    }

    fn connect(&mut self, env: &DistEnv) -> Result<(), DistError> {
        let deadline = Instant::now() + self.timeout;
        let mut s = loop {
            match TcpStream::connect((env.master_addr.as_str(), env.master_port)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(rendezvous(env, format!("rank 0 not reachable: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        self.configure(&s, 2 * self.timeout)
            .map_err(|e| rendezvous(env, e))?;
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(self.rank as u64).to_le_bytes());
        hello.extend_from_slice(&(self.world as u64).to_le_bytes());
        write_frame(&mut s, "hello", &hello).map_err(|e| rendezvous(env, e))?;
        let (op, msg) = read_frame(&mut s).map_err(|e| io_error("join", 0, e, 2 * self.timeout))?;
        if op == ERROR_OP {
            return Err(rendezvous(env, String::from_utf8_lossy(&msg)));
        }
        self.links[0] = Some(s);
        Ok(())
    }

    fn configure(&self, s: &TcpStream, read: Duration) -> std::io::Result<()> {
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(read))?;
        s.set_write_timeout(Some(2 * self.timeout))
    }

    /// Rank 0: tells every rank still connected why the run ends, then closes every link.
    fn fail_all(&mut self, why: &str) {
        for s in self.links.iter_mut().flatten() {
            let _ = write_frame(s, ERROR_OP, why.as_bytes());
        }
        self.links.iter_mut().for_each(|l| *l = None);
        self.broken = Some(why.to_string());
    }

    fn gather_at_root(
        &mut self,
        op: &'static str,
        bytes: &[u8],
    ) -> Result<Vec<Vec<u8>>, DistError> {
        let mut parts = vec![bytes.to_vec()];
        for r in 1..self.world {
            let got = match self.links[r].as_mut() {
                Some(s) => read_frame(s).map_err(|e| io_error(op, r, e, self.timeout)),
                None => Err(DistError::RankLost {
                    op,
                    rank: r,
                    why: "not connected".into(),
                }),
            };
            let err = match got {
                Ok((o, p)) if o == op => {
                    parts.push(p);
                    continue;
                }
                Ok((o, _)) => DistError::RankLost {
                    op,
                    rank: r,
                    why: format!("it called {o} where rank 0 called {op}"),
                },
                Err(e) => e,
            };
            self.fail_all(&err.to_string());
            return Err(err);
        }
        let mut reply = (parts.len() as u64).to_le_bytes().to_vec();
        for p in &parts {
            reply.extend_from_slice(&(p.len() as u64).to_le_bytes());
            reply.extend_from_slice(p);
        }
        for r in 1..self.world {
            if let Some(s) = self.links[r].as_mut() {
                if let Err(e) = write_frame(s, op, &reply) {
                    let err = io_error(op, r, e, self.timeout);
                    self.fail_all(&err.to_string());
                    return Err(err);
                }
            }
        }
        Ok(parts)
    }

    fn gather_at_leaf(
        &mut self,
        op: &'static str,
        bytes: &[u8],
    ) -> Result<Vec<Vec<u8>>, DistError> {
        let timeout = 2 * self.timeout;
        let Some(s) = self.links[0].as_mut() else {
            return Err(DistError::RankLost {
                op,
                rank: 0,
                why: "not connected".into(),
            });
        };
        let reply = write_frame(s, op, bytes)
            .and_then(|_| read_frame(s))
            .map_err(|e| io_error(op, 0, e, timeout));
        let (o, reply) = match reply {
            Ok(r) => r,
            Err(e) => {
                self.broken = Some(e.to_string());
                return Err(e);
            }
        };
        if o != op {
            let why = if o == ERROR_OP {
                String::from_utf8_lossy(&reply).into_owned()
            } else {
                format!("rank 0 answered {o} to {op}")
            };
            self.broken = Some(why.clone());
            return Err(DistError::RankLost { op, rank: 0, why });
        }
        unpack(&reply).ok_or_else(|| DistError::RankLost {
            op,
            rank: 0,
            why: "a malformed reply".into(),
        })
    }
}

/// The parts of rank 0's reply: a count, then each part's length and bytes.
fn unpack(reply: &[u8]) -> Option<Vec<Vec<u8>>> {
    let word = |at: usize| -> Option<usize> {
        let b = reply.get(at..at + 8)?;
        usize::try_from(u64::from_le_bytes(b.try_into().ok()?)).ok()
    };
    let count = word(0)?;
    let mut at = 8;
    let mut parts = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let n = word(at)?;
        at += 8;
        parts.push(reply.get(at..at.checked_add(n)?)?.to_vec());
        at += n;
    }
    Some(parts)
}

impl Collective for Tcp {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_gather(&mut self, op: &'static str, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        if let Some(why) = &self.broken {
            return Err(DistError::RankLost {
                op,
                rank: self.rank,
                why: format!("the group broke earlier: {why}"),
            });
        }
        if self.world == 1 {
            return Ok(vec![bytes.to_vec()]);
        }
        if self.rank == 0 {
            self.gather_at_root(op, bytes)
        } else {
            self.gather_at_leaf(op, bytes)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(port: u16, world: usize, rank: usize) -> DistEnv {
        DistEnv {
            master_addr: "127.0.0.1".into(),
            master_port: port,
            world_size: world,
            rank,
            local_rank: rank,
        }
    }

    /// Runs `f(rank, port)` on every rank of a group of `world` on this machine, one thread each.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(usize, u16) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(move || f(r, port))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn tcp_ranks_agree_bit_for_bit() {
        let out = on_ranks(3, |r, port| {
            let mut c = Tcp::join(&env(port, 3, r), Duration::from_secs(20)).unwrap();
            let mut v = vec![0.1 + r as f32, 1e8, -1e8 + r as f32 * 1e-3];
            c.all_reduce_sum(&mut v).unwrap();
            let oom = c.any(r == 1).unwrap();
            let id = c.broadcast(format!("from {r}").as_bytes()).unwrap();
            (v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), oom, id)
        });
        let parts: Vec<Vec<f32>> = (0..3)
            .map(|r| vec![0.1 + r as f32, 1e8, -1e8 + r as f32 * 1e-3])
            .collect();
        let want: Vec<f32> = (0..3)
            .map(|i| (parts[0][i] + parts[1][i]) + parts[2][i])
            .collect();
        for o in out {
            assert_eq!(o.0, want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            assert!(o.1);
            assert_eq!(o.2, b"from 0");
        }
    }

    #[test]
    fn a_rank_that_dies_ends_the_run_on_the_others_with_its_number() {
        let start = Instant::now();
        let out = on_ranks(3, |r, port| {
            let mut c = Tcp::join(&env(port, 3, r), Duration::from_secs(30)).unwrap();
            if r == 2 {
                return None; // dropped: its socket closes, as when the process dies
            }
            let mut v = vec![1.0f32];
            Some(c.all_reduce_sum(&mut v).unwrap_err().to_string())
        });
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        for e in out.into_iter().flatten() {
            assert!(e.contains("rank 2"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_never_joins_times_out_every_rank() {
        let out = on_ranks(3, |r, port| {
            if r == 2 {
                return None;
            }
            let c = Tcp::join(&env(port, 3, r), Duration::from_millis(500));
            Some(c.map(|_| ()).unwrap_err().to_string())
        });
        let errs: Vec<String> = out.into_iter().flatten().collect();
        assert!(errs[0].contains("[2] did not arrive"), "{}", errs[0]);
        assert!(errs[1].contains("ranks [2] never joined"), "{}", errs[1]);
    }
}
