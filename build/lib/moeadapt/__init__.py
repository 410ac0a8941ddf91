"""moeadapt: train and fine-tune trillion-parameter sparse MoE models with hybrid KDA / gated-DSA attention."""

__version__ = "0.1.0"
