//! The rendezvous environment of a multi-process run, as torchrun sets it: `MASTER_ADDR`,
//! `MASTER_PORT`, `WORLD_SIZE`, `RANK` and `LOCAL_RANK`.

use super::DistError;

/// The variables read, in the order they are checked.
pub const ENV_KEYS: [&str; 5] = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
];

/// One process's place in a multi-process run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub master_addr: String,
    pub master_port: u16,
    pub world_size: usize,
    pub rank: usize,
    /// The rank on this machine: which card it takes. Defaults to `rank`.
    pub local_rank: usize,
}

fn bad(key: &'static str, value: &str, why: &str) -> DistError {
    DistError::Env {
        key,
        value: value.to_string(),
        why: why.to_string(),
    }
}

fn number<T: std::str::FromStr>(key: &'static str, value: &str) -> Result<T, DistError> {
    value
        .trim()
        .parse()
        .map_err(|_| bad(key, value, "not a whole number"))
}

impl DistEnv {
    /// The run's place from the process environment; `None` when `WORLD_SIZE` is unset (a
    /// one-process run).
    pub fn from_env() -> Result<Option<Self>, DistError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`DistEnv::from_env`] over any lookup (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DistError> {
        let Some(world) = get("WORLD_SIZE") else {
            return Ok(None);
        };
        let world_size: usize = number("WORLD_SIZE", &world)?;
        if world_size == 0 {
            return Err(bad("WORLD_SIZE", &world, "must be at least 1"));
        }
        let need = |key: &'static str| {
            get(key)
                .ok_or_else(|| bad(key, "", "must be set when WORLD_SIZE is (torchrun sets it)"))
        };
        let rank_s = need("RANK")?;
        let rank: usize = number("RANK", &rank_s)?;
        if rank >= world_size {
            return Err(bad(
                "RANK",
                &rank_s,
                &format!("must be below WORLD_SIZE ({world_size})"),
            ));
        }
        let master_addr = need("MASTER_ADDR")?;
        // An IPv6 address may come bracketed, as in a URL (`[fe80::1]`).
        let host = master_addr.trim();
        let host = match host.strip_prefix('[') {
            Some(rest) => rest
                .strip_suffix(']')
                .ok_or_else(|| bad("MASTER_ADDR", &master_addr, "opens a `[` it does not close"))?,
            None => host,
        };
        if host.is_empty() {
            return Err(bad("MASTER_ADDR", &master_addr, "is empty"));
        }
        let port_s = need("MASTER_PORT")?;
        let master_port: u16 = number("MASTER_PORT", &port_s)?;
        if master_port == 0 {
            return Err(bad(
                "MASTER_PORT",
                &port_s,
                "must be a port from 1 to 65535",
            ));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", &v)?,
            None => rank,
        };
        Ok(Some(Self {
            master_addr: host.to_string(),
            master_port,
            world_size,
            rank,
            local_rank,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT` (an IPv6 address bracketed).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn torchrun_variables_are_read() {
        let env = [
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "8"),
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
        ];
        let d = DistEnv::from_lookup(lookup(&env)).unwrap().unwrap();
        assert_eq!((d.world_size, d.rank, d.local_rank), (8, 5, 1));
        assert_eq!(d.master(), "10.0.0.1:29500");
        assert_eq!(DistEnv::from_lookup(lookup(&[])).unwrap(), None);
    }

    /// An IPv6 MASTER_ADDR, bare or bracketed, is the same host; the address printed in errors
    /// brackets it so that its port stands apart.
    #[test]
    fn an_ipv6_master_address_is_read_bare_or_bracketed() {
        for addr in ["::1", "[::1]", " [::1] "] {
            let env = [
                ("MASTER_ADDR", addr),
                ("MASTER_PORT", "29500"),
                ("WORLD_SIZE", "2"),
                ("RANK", "0"),
            ];
            let d = DistEnv::from_lookup(lookup(&env)).unwrap().unwrap();
            assert_eq!(d.master_addr, "::1", "{addr:?}");
            assert_eq!(d.master(), "[::1]:29500", "{addr:?}");
        }
    }

    #[test]
    fn bad_variables_name_the_key() {
        let cases: [(&[(&str, &str)], &str); 7] = [
            (&[("WORLD_SIZE", "two")], "WORLD_SIZE"),
            (&[("WORLD_SIZE", "2")], "RANK"),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "2")],
                "RANK=\"2\": must be below",
            ),
            (&[("WORLD_SIZE", "2"), ("RANK", "1")], "MASTER_ADDR"),
            (
                &[
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "0"),
                ],
                "MASTER_PORT",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "[::1")],
                "MASTER_ADDR=\"[::1\": opens a `[`",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "[]")],
                "MASTER_ADDR=\"[]\": is empty",
            ),
        ];
        for (env, want) in cases {
            let e = DistEnv::from_lookup(lookup(env)).unwrap_err().to_string();
            assert!(e.contains(want), "{env:?}: {e}");
        }
    }
}
