//! [`ForwardBatch`]: the rows of one forward pass, flattened over the
//! sequences they extend, with the positions, KV slots and block tables
//! the kernels read.

/// The host-side description of one batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ForwardBatch {
    /// New tokens of all sequences, flattened.
    pub tokens: Vec<u32>,
    /// Absolute position of each row in its sequence.
    pub positions: Vec<u32>,
    /// Index of each row's sequence in `block_tables`.
    pub row_seq: Vec<u32>,
    /// KV slot each row writes.
    pub slots: Vec<u32>,
    /// `[num_seqs, max_blocks_per_seq]` block ids, row-major, zero-padded.
    pub block_tables: Vec<u32>,
    pub max_blocks_per_seq: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Rows whose logits are wanted, in the order they are returned.
    pub logit_rows: Vec<u32>,
    /// `[rows, hidden]`: for an EAGLE head (`ModelConfig::reads_hidden`),
    /// the target's hidden state each row reads beside its token; empty
    /// for any other model.
    pub input_hidden: Vec<f32>,
}

impl ForwardBatch {
    pub fn new(block_size: usize, max_blocks_per_seq: usize) -> Self {
        Self {
            block_size,
            max_blocks_per_seq,
            ..Default::default()
        }
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Appends the rows of one sequence; `block_table` is its whole table.
    pub fn push_sequence(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        slots: &[u32],
        block_table: &[u32],
    ) {
        let seq = (self.block_tables.len() / self.max_blocks_per_seq.max(1)) as u32;
        debug_assert_eq!(tokens.len(), slots.len());
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((start_pos..start_pos + tokens.len()).map(|p| p as u32));
        self.row_seq.extend(std::iter::repeat_n(seq, tokens.len()));
        self.slots.extend_from_slice(slots);
        let mut row = block_table.to_vec();
        row.resize(self.max_blocks_per_seq, 0);
        self.block_tables.extend(row);
    }

    /// The rows `rows` alone (a pipeline micro-batch): every sequence's
    /// block table stays, and no logits are asked for.
    pub fn part(&self, rows: std::ops::Range<usize>) -> Self {
        Self {
            tokens: self.tokens[rows.clone()].to_vec(),
            positions: self.positions[rows.clone()].to_vec(),
            row_seq: self.row_seq[rows.clone()].to_vec(),
            slots: self.slots[rows].to_vec(),
            block_tables: self.block_tables.clone(),
            logit_rows: Vec::new(),
            input_hidden: Vec::new(),
            ..*self
        }
    }
}
