

def test_the_sae_sample_walks_the_whole_path(tmp_path):
    """sample_runs/sae.py, shortened: a GPT-2 recorded with its token ids, a sparse
    autoencoder trained on the rows, its loss drawn."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "sample_runs", "sae.py")
    spec = importlib.util.spec_from_file_location("sae_sample", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    got = sample.main(str(tmp_path), steps=6, epochs=2)
    sae = got["sae"]
    assert sae["rows"] == 6 * sample.BATCH * sample.SEQ
    assert sae["tokens_seen"] <= set(range(sample.VOCAB)) and len(sae["tokens_seen"]) > 10
    assert sae["fvu"][-1] < sae["fvu"][0]
    assert (tmp_path / "sae.png").stat().st_size > 0
