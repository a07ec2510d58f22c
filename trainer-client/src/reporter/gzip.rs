//! Gzip bodies from one deflate state kept for the whole run. A fresh compressor
//! (`GzEncoder::new`) allocates and zeroes its hash tables, which cost the reporter
//! as many instructions as compressing a 50-step batch; `Compress::reset` keeps them.

use flate2::{Compress, CompressError, Compression, Crc, FlushCompress, Status};

/// RFC 1952's member header: deflate, no flags, no time, unknown OS.
const HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];

pub(super) struct Gzip {
    deflate: Compress,
}

impl Gzip {
    pub(super) fn new() -> Gzip {
        Gzip {
            deflate: Compress::new(Compression::fast(), false),
        }
    }

    /// `data` as one gzip member.
    pub(super) fn encode(&mut self, data: &[u8]) -> Result<Vec<u8>, CompressError> {
        self.deflate.reset();
        let mut out = Vec::with_capacity(HEADER.len() + data.len() / 2 + 64);
        out.extend_from_slice(&HEADER);
        loop {
            let read = self.deflate.total_in() as usize;
            match self
                .deflate
                .compress_vec(&data[read..], &mut out, FlushCompress::Finish)?
            {
                Status::StreamEnd => break,
                // Out of room: `compress_vec` writes only into spare capacity.
                Status::Ok | Status::BufError => out.reserve(out.capacity()),
            }
        }
        let mut crc = Crc::new();
        crc.update(data);
        out.extend_from_slice(&crc.sum().to_le_bytes());
        // ISIZE is the length modulo 2³².
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use rand::{Rng, SeedableRng};

    use super::*;

    fn gunzip(body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(body)
            .read_to_end(&mut out)
            .expect("a valid gzip member");
        out
    }

    #[test]
    fn every_body_decodes_to_its_input_with_the_state_reused() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Incompressible bytes outgrow the first guess at the output's size.
        let noise: Vec<u8> = (0..200_000).map(|_| rng.r#gen()).collect();
        let json = br#"[{"step":0,"loss":2.5,"modules":[{"module":"qwen.layers.0.mlp","grad_norm":0.5}]}]"#
            .repeat(500);
        let mut gzip = Gzip::new();
        for data in [&json[..], &noise[..], b"", b"[]", &json[..]] {
            let body = gzip.encode(data).unwrap();
            assert_eq!(gunzip(&body), data, "{} bytes", data.len());
        }
        let small = gzip.encode(&json).unwrap();
        assert!(small.len() * 10 < json.len(), "{} bytes", small.len());
    }
}
