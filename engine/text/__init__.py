"""Text and tokens: the tokenizer and chat templates, and incremental detokenization."""
