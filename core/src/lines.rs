//! Instruction position → source line, the way Ruby's `rb_iseq_line_no` computes it: the
//! iseq's `insns_info` entries are indexed through a succinct bit vector
//! (`succ_index_table`, iseq.c) that maps an instruction position to the rank of the entry
//! covering it.
use crate::error::{ObjResult, ObjectError};
use crate::memory::Memory;
use crate::memory::{word, word32};
use rbspy_ext_bindings::Layout;

/// Most `insns_info` entries the spy copies for one iseq (Ruby methods have far fewer).
const MAX_ENTRIES: u64 = 1 << 20;

/// A copy of one iseq's line information.
#[derive(Debug, Clone, Default)]
pub struct LineTable {
    lines: Vec<i32>,
    /// The raw succinct table (immediate part + dictionary blocks); empty when there are
    /// fewer than two entries.
    succ: Vec<u8>,
    imm_part_len: usize,
    block_size: usize,
    block_rank: usize,
    block_small_ranks: usize,
    block_bits: usize,
    immediate: usize,
}

impl LineTable {
    /// Copies the table of an iseq whose body fields are given.
    pub fn read<M: Memory>(
        mem: &M,
        l: &Layout,
        entries: u64,
        entry_count: u64,
        succ_table: u64,
        iseq_size: u64,
    ) -> ObjResult<LineTable> {
        if entry_count > MAX_ENTRIES || iseq_size > MAX_ENTRIES * 64 {
            return Err(ObjectError::Shape("insns_info", entries));
        }
        let raw = mem.read_vec(entries, entry_count as usize * l.insn_info_entry_size)?;
        let lines = raw
            .chunks_exact(l.insn_info_entry_size)
            .map(|e| word32(e, l.insn_info_entry_line_no) as i32)
            .collect();
        // Sizes as iseq.c's succ_index_table_create computes them from max_pos = iseq_size.
        let imm = l.succ_immediate_table_size as u64;
        let imm_size = if iseq_size < imm { iseq_size + 8 } else { imm } / 9;
        let succ_size = if iseq_size < imm {
            0
        } else {
            (iseq_size - imm).div_ceil(512)
        };
        let succ = if entry_count > 1 {
            if succ_table == 0 {
                return Err(ObjectError::Shape("succ_index_table", succ_table));
            }
            mem.read_vec(
                succ_table,
                (imm_size * 8 + succ_size * l.succ_dict_block_size as u64) as usize,
            )?
        } else {
            Vec::new()
        };
        Ok(LineTable {
            lines,
            succ,
            imm_part_len: (imm / 9) as usize * 8,
            block_size: l.succ_dict_block_size,
            block_rank: l.succ_dict_block_rank,
            block_small_ranks: l.succ_dict_block_small_block_ranks,
            block_bits: l.succ_dict_block_bits,
            immediate: l.succ_immediate_table_size,
        })
    }

    /// The line of the instruction at `pos` (in VALUE words from `iseq_encoded`), or None when
    /// `pos` lies outside the table (the caller treats that as a stack that changed).
    pub fn line_at(&self, pos: usize) -> Option<i32> {
        match self.lines.len() {
            0 => Some(0),
            1 => Some(self.lines[0]),
            _ => {
                let rank = self.rank(pos)?;
                self.lines.get(rank.checked_sub(1)?).copied()
            }
        }
    }

    fn rank(&self, x: usize) -> Option<usize> {
        if x < self.immediate {
            let v = word(self.succ.get((x / 9) * 8..(x / 9) * 8 + 8)?, 0);
            return Some(((v >> ((x % 9) * 7)) & 0x7f) as usize);
        }
        let block_index = (x - self.immediate) / 512;
        let start = self.imm_part_len + block_index * self.block_size;
        let block = self.succ.get(start..start + self.block_size)?;
        let bit_index = (x - self.immediate) % 512;
        let small = bit_index / 64;
        let small_rank = if small == 0 {
            0
        } else {
            ((word(block, self.block_small_ranks) >> ((small - 1) * 9)) & 0x1ff) as usize
        };
        let bits = word(block, self.block_bits + small * 8);
        let popcount = (bits << (63 - bit_index % 64)).count_ones() as usize;
        Some(word32(block, self.block_rank) as usize + small_rank + popcount)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryImage;
    use rbspy_ext_bindings::LAYOUTS;

    /// Builds a succinct table the way iseq.c's succ_index_table_create does, for
    /// `positions` (sorted instruction positions where a new line entry starts).
    fn encode(l: &Layout, max_pos: usize, positions: &[usize]) -> Vec<u8> {
        let imm = l.succ_immediate_table_size;
        let imm_size = if max_pos < imm { max_pos + 8 } else { imm } / 9;
        let succ_size = if max_pos < imm {
            0
        } else {
            (max_pos - imm).div_ceil(512)
        };
        let mut out = vec![0u8; imm_size * 8 + succ_size * l.succ_dict_block_size];
        let mut r = 0usize;
        for j in 0..imm_size {
            let mut v = 0u64;
            for i in 0..9 {
                if r < positions.len() && positions[r] == j * 9 + i {
                    r += 1;
                }
                v |= (r as u64) << (7 * i);
            }
            out[j * 8..j * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        for k in 0..succ_size {
            let base = imm_size * 8 + k * l.succ_dict_block_size;
            out[base..base + 4].copy_from_slice(&(r as u32).to_le_bytes());
            let mut small_ranks = 0u64;
            let mut small_r = 0u64;
            for j in 0..8 {
                if j > 0 {
                    small_ranks |= small_r << (9 * (j - 1));
                }
                let mut bits = 0u64;
                for i in 0..64 {
                    if r < positions.len() && positions[r] == k * 512 + j * 64 + i + imm {
                        bits |= 1 << i;
                        r += 1;
                        small_r += 1;
                    }
                }
                let at = base + l.succ_dict_block_bits + j * 8;
                out[at..at + 8].copy_from_slice(&bits.to_le_bytes());
            }
            let at = base + l.succ_dict_block_small_block_ranks;
            out[at..at + 8].copy_from_slice(&small_ranks.to_le_bytes());
        }
        out
    }

    #[test]
    fn lookup_matches_a_linear_search_over_every_position() {
        for l in LAYOUTS {
            lookup_matches_a_linear_search(l);
        }
    }

    fn lookup_matches_a_linear_search(l: &Layout) {
        for max_pos in [5usize, 53, 54, 60, 700, 1500] {
            // A new line entry every 3 instructions, with a gap, as a compiler would emit.
            let positions: Vec<usize> = (0..max_pos).filter(|p| p % 3 == 0 && p % 7 != 6).collect();
            let lines: Vec<i32> = (0..positions.len() as i32).map(|i| 10 + i * 2).collect();
            let mut entries = Vec::new();
            for line in &lines {
                let mut entry = vec![0u8; l.insn_info_entry_size];
                let at = l.insn_info_entry_line_no;
                entry[at..at + 4].copy_from_slice(&line.to_le_bytes());
                entries.extend_from_slice(&entry);
            }
            let mut mem = MemoryImage::new();
            mem.map(0x10000, entries);
            mem.map(0x80000, encode(l, max_pos, &positions));
            let table = LineTable::read(
                &mem,
                l,
                0x10000,
                lines.len() as u64,
                0x80000,
                max_pos as u64,
            )
            .unwrap();
            for pos in 0..max_pos {
                let expected = positions.iter().rposition(|p| *p <= pos).map(|i| lines[i]);
                assert_eq!(table.line_at(pos), expected, "max_pos {max_pos} pos {pos}");
            }
        }
    }

    #[test]
    fn single_entry_tables_need_no_succinct_part() {
        let l = &LAYOUTS[0];
        let mut mem = MemoryImage::new();
        let mut entry = vec![0u8; l.insn_info_entry_size];
        entry[l.insn_info_entry_line_no..l.insn_info_entry_line_no + 4]
            .copy_from_slice(&7i32.to_le_bytes());
        mem.map(0x10000, entry);
        let table = LineTable::read(&mem, l, 0x10000, 1, 0, 10).unwrap();
        assert_eq!(table.line_at(4), Some(7));
    }
}
