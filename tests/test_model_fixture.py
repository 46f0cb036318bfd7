from transformers import AutoTokenizer


def test_tiny_model_tokenizer_knows_real_words(tiny_model_dir):
    # guards against the transformers 5 trap where a tokenizer silently maps every word to [UNK]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("wonderful flight")["input_ids"]
    assert tok.unk_token_id not in ids
    assert len(tok) > 30000
