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

/// Reads one frame. The payload is read as it arrives, never allocated from the length field
/// alone, so a frame that lies about its length (a stray connection's bytes) costs only what was
/// sent; `limit` refuses a longer one outright.
fn read_frame_within(s: &mut TcpStream, limit: u64) -> std::io::Result<(String, Vec<u8>)> {
    let mut len = [0u8; 1];
    s.read_exact(&mut len)?;
    let mut op = vec![0u8; usize::from(len[0])];
    s.read_exact(&mut op)?;
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let n = u64::from_le_bytes(n);
    if n > limit {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a frame of {n} bytes (at most {limit})"),
        ));
    }
    let mut payload = Vec::with_capacity(usize::try_from(n.min(1 << 20)).unwrap_or(0));
    s.take(n).read_to_end(&mut payload)?;
    if payload.len() as u64 != n {
        return Err(ErrorKind::UnexpectedEof.into());
    }
    Ok((String::from_utf8_lossy(&op).into_owned(), payload))
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(String, Vec<u8>)> {
    read_frame_within(s, u64::MAX)
}

/// How long rank 0 waits for a new connection's greeting before closing it as stray.
const GREETING_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a connection was not taken as a rank.
enum Greeting {
    /// Not an sdtrain rank: closed, and the wait goes on.
    Stray,
    /// An sdtrain rank of another run shape: the run cannot start.
    Fatal(DistError),
}

/// Rank 0's listening sockets on `MASTER_PORT`: IPv6 and IPv4 on every interface, so that
/// `MASTER_ADDR` may name either. Where the IPv6 socket takes IPv4 as well (Linux's default), the
/// IPv4 bind finds the port in use and the one socket serves both; where there is no IPv6, the
/// IPv4 socket alone.
fn listen(env: &DistEnv) -> Result<Vec<TcpListener>, DistError> {
    let v6 = TcpListener::bind((std::net::Ipv6Addr::UNSPECIFIED, env.master_port));
    let v4 = TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, env.master_port));
    let listeners: Vec<TcpListener> = match (v6, v4) {
        (Ok(a), Ok(b)) => vec![a, b],
        (Ok(a), Err(_)) => vec![a],
        (Err(_), Ok(b)) => vec![b],
        (Err(_), Err(e)) => {
            let hint = if e.kind() == ErrorKind::AddrInUse {
                " (another process holds MASTER_PORT; under torchrun its agent's store does: \
                 sdtrain needs no launcher, run it on each machine with the environment set, \
                 or pick a free port)"
            } else {
                ""
            };
            return Err(rendezvous(
                env,
                format!(
                    "rank 0 cannot listen on port {}: {e}{hint}",
                    env.master_port
                ),
            ));
        }
    };
    for l in &listeners {
        l.set_nonblocking(true).map_err(|e| rendezvous(env, e))?;
    }
    Ok(listeners)
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
        let listeners = listen(env)?;
        let deadline = Instant::now() + self.timeout;
        while self.links.iter().skip(1).any(Option::is_none) {
            let mut accepted = false;
            for listener in &listeners {
                match listener.accept() {
                    Ok((s, from)) => {
                        accepted = true;
                        if let Err(e) = self.greet(env, s) {
                            if let Greeting::Fatal(e) = e {
                                self.fail_all(&e.to_string());
                                return Err(e);
                            }
                            eprintln!(
                                "warning: rendezvous at {}: closed a connection from {from} \
                                 that is not an sdtrain rank",
                                env.master()
                            );
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(rendezvous(env, e)),
                }
            }
            if accepted {
                continue;
            }
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
        for r in 1..self.world {
            if let Some(s) = self.links[r].as_mut() {
                write_frame(s, "ready", &[]).map_err(|e| io_error("join", r, e, self.timeout))?;
            }
        }
        Ok(())
    }

    /// Reads a joining rank's greeting and keeps its stream. A connection that does not greet as
    /// an sdtrain rank within [`GREETING_TIMEOUT`] (a port scan, a health check) is a
    /// [`Greeting::Stray`]; a rank of another shape of run is [`Greeting::Fatal`].
    fn greet(&mut self, env: &DistEnv, mut s: TcpStream) -> Result<(), Greeting> {
        let stray = |_| Greeting::Stray;
        self.configure(&s, GREETING_TIMEOUT.min(self.timeout))
            .map_err(stray)?;
        let (op, hello) = read_frame_within(&mut s, 24).map_err(stray)?;
        if op != "hello" || hello.len() != 24 || &hello[..8] != MAGIC {
            return Err(Greeting::Stray);
        }
        let word = |i: usize| u64::from_le_bytes(hello[i..i + 8].try_into().unwrap_or_default());
        let (rank, world) = (word(8) as usize, word(16) as usize);
        if world != self.world || rank == 0 || rank >= self.world || self.links[rank].is_some() {
            let why = format!(
                "a rank says it is {rank} of {world}; this run has {}",
                self.world
            );
            let _ = write_frame(&mut s, ERROR_OP, why.as_bytes());
            return Err(Greeting::Fatal(rendezvous(env, why)));
        }
        self.configure(&s, self.timeout)
            .map_err(|e| Greeting::Fatal(rendezvous(env, e)))?;
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

    /// Rank 0 listens on IPv6 and IPv4: a MASTER_ADDR of `::1`, `127.0.0.1` or a host name
    /// reaches it. Catches a listener bound to IPv4 only (`::1` is refused until the timeout).
    #[test]
    fn master_addresses_in_ipv6_ipv4_or_by_name_reach_rank_0() {
        for addr in ["::1", "127.0.0.1", "localhost"] {
            if addr == "::1" && TcpListener::bind("[::1]:0").is_err() {
                eprintln!("no IPv6 loopback on this machine: ::1 not tried");
                continue;
            }
            let out = on_ranks(2, move |r, port| {
                let mut e = env(port, 2, r);
                e.master_addr = addr.into();
                let mut c = Tcp::join(&e, Duration::from_secs(5)).map_err(|e| e.to_string())?;
                c.broadcast(b"hello").map_err(|e| e.to_string())
            });
            for o in out {
                assert_eq!(o.as_deref(), Ok(&b"hello"[..]), "MASTER_ADDR={addr}");
            }
        }
    }

    /// Connections that are not ranks (a port scan, a health check, an HTTP request, a frame that
    /// claims 2^60 bytes, another program's greeting) are closed and the rendezvous goes on. Catches a stray
    /// connection that ends the run, and a frame allocated from its length field alone (which
    /// aborts the process).
    #[test]
    fn stray_connections_are_closed_and_the_rendezvous_goes_on() {
        let out = on_ranks(2, |r, port| {
            if r == 1 {
                let connect = || loop {
                    match TcpStream::connect(("127.0.0.1", port)) {
                        Ok(s) => break s,
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                };
                drop(connect());
                let mut http = connect();
                http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    .unwrap();
                let mut huge = connect();
                let mut frame = vec![5u8];
                frame.extend_from_slice(b"hello");
                frame.extend_from_slice(&(1u64 << 60).to_le_bytes());
                huge.write_all(&frame).unwrap();
                // A well-formed greeting without sdtrain's magic (another program's frames).
                let mut other = connect();
                write_frame(&mut other, "hello", &[7u8; 24]).unwrap();
                drop((http, huge, other));
            }
            let mut c = Tcp::join(&env(port, 2, r), Duration::from_secs(20)).unwrap();
            c.broadcast(b"joined").unwrap()
        });
        assert_eq!(out, vec![b"joined".to_vec(), b"joined".to_vec()]);
    }

    /// A rank of another run shape is no stray: the rendezvous fails on both sides, naming it.
    #[test]
    fn a_rank_of_another_world_size_ends_the_rendezvous() {
        let port = free_port();
        let root = std::thread::spawn(move || {
            Tcp::join(&env(port, 2, 0), Duration::from_secs(10))
                .map(|_| ())
                .unwrap_err()
                .to_string()
        });
        let leaf = Tcp::join(&env(port, 3, 1), Duration::from_secs(10))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        let root = root.join().unwrap();
        for e in [root, leaf] {
            assert!(
                e.contains("a rank says it is 1 of 3; this run has 2"),
                "{e}"
            );
        }
    }

    /// Rank 0 cannot listen where another process does, and says what to do about it.
    #[test]
    fn a_taken_master_port_is_named_with_the_likely_cause() {
        let taken = TcpListener::bind(("0.0.0.0", 0)).unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = Tcp::join(&env(port, 2, 0), Duration::from_secs(1))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("cannot listen on port {port}")), "{e}");
        assert!(e.contains("torchrun"), "{e}");
    }
}
