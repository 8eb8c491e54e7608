"""benchmark/quant_agree.py (issue 38's cross-engine check, run against vLLM on the GPU machine): this engine's
side on the cpu, and the verdict on constructed cases."""
import json
import random

from helpers import benchmark_module
from engine_utils import engine_tokens

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, vocab_size=600)


def test_ours_records_greedy_tokens_and_their_logprobs(tmp_path):
    qa, rm = benchmark_module('quant_agree'), benchmark_module('random_model')
    model = rm.make_model('llama-small', str(tmp_path / 'm'), dtype='float32', seed=random.randrange(1 << 30),
                          **SMALL)
    prompts = qa.make_prompts(SMALL['vocab_size'], seed=random.randrange(1 << 30), n=3)
    rows = qa.run_ours(model, 'cpu', 'float32', prompts, 6)
    assert [r['tokens'] for r in rows] == engine_tokens(model, prompts, 6, device_type='cpu', dtype='float32',
                                                          session_len=512, cache_max_entry_count=0.05)
    for r in rows:
        assert len(r['top']) == len(r['chosen_logit']) == 6
        for tok, top in zip(r['tokens'], r['top']):
            assert len(top) == qa.TOP and max(top, key=top.get) == tok and all(v <= 0 for v in top.values())
    path = tmp_path / 'ours.json'
    path.write_text(json.dumps({'model': model, 'engine': 'ours', 'rows': rows}))
    assert qa.compare(str(path), str(path))  # an engine agrees with itself


def test_verdict():
    qa = benchmark_module('quant_agree')

    def row(tokens, tops, logit=10.0):
        return {'tokens': tokens, 'top': tops, 'chosen_logit': [logit] * len(tokens)}

    same = qa.verdict(row([5, 6], [{5: -0.1, 7: -3.0}, {6: -0.2, 8: -2.0}]),
                      row([5, 6], [{5: -0.15, 7: -3.0}, {6: -0.2}]))
    assert same['ok'] and same['equal'] == 2 and abs(same['max_dlogprob'] - 0.05) < 1e-9
    # step 1: ours 6 over 8 by 0.1, vLLM 8 over 6 by 0.05; logit 10: a tie up to 0.2
    tie = qa.verdict(row([5, 6], [{5: -0.1}, {6: -0.7, 8: -0.8}]), row([5, 8], [{5: -0.1}, {8: -0.7, 6: -0.75}]))
    assert tie['ok'] and tie['equal'] == 1 and 'near tie' in tie['why']
    gap = qa.verdict(row([5, 6], [{5: -0.1}, {6: -0.1, 8: -2.5}]), row([5, 8], [{5: -0.1}, {8: -0.7, 6: -0.75}]))
    assert not gap['ok'] and 'not a tie' in gap['why']
    outside = qa.verdict(row([6], [{6: -0.1, 9: -2.0}]), row([8], [{8: -0.1, 6: -0.3}]))
    assert not outside['ok'] and 'outside' in outside['why']
