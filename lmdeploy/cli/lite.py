"""``lmdeploy lite auto_awq|auto_gptq MODEL --work-dir OUT``: quantize a model's weights offline (4-bit).

Writes OUT: safetensors in AutoAWQ's GEMM layout (auto_awq: config.json's ``quantization_config`` is
``quant_method: awq``, ``version: gemm``, ``bits: 4``, ``group_size``, ``zero_point: true``) or GPTQ's
checkpoint format "gptq" as AutoGPTQ / GPTQModel write it (auto_gptq: ``quant_method: gptq``, ``bits: 4``,
``group_size``, ``desc_act``, ``sym``; quantize_config.json too), and the model's tokenizer, chat template and
generation config copied; ``lmdeploy serve api_server OUT`` and ``pipeline(OUT)`` load it.
Llama, Mistral, Qwen2 and Qwen3 models. Calibration text: by default Python's own reference topics
(``pydoc_data.topics``, shipped with every Python, about 113k tokens; no network), or ``--calib-dataset
PATH``: a local .txt file, or .jsonl with a "text" field a line.
"""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    lite = sub.add_parser('lite', help='quantize a model offline (auto_awq, auto_gptq, smooth_quant, calibrate)',
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = lite.add_subparsers(dest='lite_command', metavar='{auto_awq,auto_gptq,smooth_quant,calibrate}')
    p = cmds.add_parser('auto_awq', help='AWQ 4-bit weights (group-wise, with zero points) into --work-dir',
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common_args(p)
    p.add_argument('--search-scale', action=argparse.BooleanOptionalAction, default=True,
                   help='grid-search each group\'s activation-aware scale exponent (AWQ, 20 points); '
                   '--no-search-scale fixes it at 0.5 as LMDeploy does without --search-scale (default: on)')
    _device_arg(p)
    _resume_arg(p)
    p.set_defaults(func=run_auto_awq)
    p = cmds.add_parser('auto_gptq', help='GPTQ 4-bit weights (group-wise, error feedback under the calibration '
                        'Hessian) into --work-dir', description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _common_args(p, per_channel=True)
    p.add_argument('--sym', action='store_true',
                   help='symmetric weights (zero point fixed at 8); default: asymmetric, a zero point a group')
    p.add_argument('--desc-act', action='store_true',
                   help='act-order: quantize the input columns in order of decreasing activation energy '
                   '(writes g_idx with desc_act: true)')
    p.add_argument('--damp-percent', type=float, default=0.01,
                   help='dampening added to the Hessian\'s diagonal, a fraction of its mean (default: %(default)s)')
    p.add_argument('--first-token-weight', type=float, default=None,
                   help='how many tokens each calibration window\'s first token (where models put massive '
                   'activations that every later token reads) counts as in the Hessian (default: a 32nd of '
                   '--calib-seqlen, at least 1)')
    _device_arg(p)
    _resume_arg(p)
    p.set_defaults(func=run_auto_gptq)
    _add_smooth_quant(cmds)
    _add_calibrate(cmds)
    lite.set_defaults(func=lambda args: _usage(lite))
    return lite


def _common_args(p, per_channel: bool = False, weights: bool = True):
    p.add_argument('model', metavar='MODEL',
                   help="local Hugging Face model directory; 'default': the embedded SmolLM2-135M-Instruct")
    p.add_argument('--work-dir', required=True, help='output directory (created; files in it are replaced)')
    p.add_argument('--calib-dataset', default=None, metavar='PATH',
                   help='calibration text: a local .txt file, or .jsonl with a "text" field a line (default: the '
                   'text of pydoc_data.topics, which ships with Python)')
    p.add_argument('--calib-samples', type=int, default=128,
                   help='calibration windows (default: %(default)s)')
    p.add_argument('--calib-seqlen', type=int, default=2048,
                   help='tokens per calibration window (default: %(default)s)')
    p.add_argument('--batch-size', type=int, default=1,
                   help='calibration windows run together; more is faster and takes more memory '
                   '(default: %(default)s)')
    if not weights:
        return
    p.add_argument('--w-bits', type=int, default=4, choices=(4, ), help='weight bits (default: %(default)s)')
    p.add_argument('--w-group-size', type=int, default=128,
                   help='input columns sharing a scale and zero point; must divide every linear layer\'s input '
                   'size (SmolLM2-135M: 64)' + ('; -1: one group a row' if per_channel else '')
                   + ' (default: %(default)s)')


def _device_arg(p):
    p.add_argument('--device', default='auto', choices=('auto', 'cpu', 'cuda'),
                   help="where layers run: 'auto' is cuda when torch sees a GPU, else cpu (default: %(default)s)")


def _resume_arg(p):
    p.add_argument('--resume', action=argparse.BooleanOptionalAction, default=True,
                   help='go on from where an interrupted run into the same --work-dir with the same arguments '
                   'stopped (its layers are kept in WORK_DIR/.lite-partial, removed when the model is written); '
                   '--no-resume starts over (default: on)')


def _usage(parser) -> int:
    parser.print_help(sys.stderr)
    return 1


def run_auto_awq(args, stdout=None) -> int:
    from lmdeploy.lite import auto_awq
    out = stdout or sys.stdout
    result = auto_awq(args.model, args.work_dir, calib_dataset=args.calib_dataset, calib_samples=args.calib_samples,
                      calib_seqlen=args.calib_seqlen, batch_size=args.batch_size, w_bits=args.w_bits,
                      w_group_size=args.w_group_size, search_scale=args.search_scale, device=args.device,
                      resume=args.resume)
    return _wrote(args, result, out)


def _wrote(args, result: dict, out) -> int:
    print(f'wrote {args.work_dir}: {result["layers"]} layers, group size {result["group_size"]}, '
          f'{result["calib_tokens"]} calibration tokens, on {result["device"]}, {result["seconds"]:.0f} s', file=out)
    return 0


def run_auto_gptq(args, stdout=None) -> int:
    from lmdeploy.lite import auto_gptq
    result = auto_gptq(args.model, args.work_dir, calib_dataset=args.calib_dataset,
                       calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen, batch_size=args.batch_size,
                       w_bits=args.w_bits, w_group_size=args.w_group_size, sym=args.sym, desc_act=args.desc_act,
                       damp_percent=args.damp_percent, device=args.device, resume=args.resume,
                       first_token_weight=args.first_token_weight)
    return _wrote(args, result, stdout or sys.stdout)


SMOOTH_QUANT_DOC = """``lmdeploy lite smooth_quant MODEL --work-dir OUT --quant-dtype int8|fp8``: SmoothQuant W8A8.

Calibrates each decoder linear group's per-input-channel activation maxima, folds the smoothing factors
s = max|X| ** alpha / max|W| ** (1 - alpha) into the preceding RMSNorm (q/k/v, gate/up) or linear (down after
up, o after v) and the weights' columns, then quantizes every decoder linear per output channel (int8, or fp8
e4m3); activations are quantized per token when the model runs. config.json's quantization_config:
``quant_method: smooth_quant``, ``quant_dtype: int8|fp8`` (lmdeploy/devices/w8a8.py). Embedding and lm_head
stay float. Llama, Mistral, Qwen2 and Qwen3 models; calibration text as for auto_awq.
"""


def _add_smooth_quant(cmds):
    p = cmds.add_parser('smooth_quant', help='SmoothQuant W8A8 (int8 or fp8 weights and activations) into '
                        '--work-dir', description=SMOOTH_QUANT_DOC,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('model', metavar='MODEL',
                   help="local Hugging Face model directory; 'default': the embedded SmolLM2-135M-Instruct")
    p.add_argument('--work-dir', required=True, help='output directory (created; files in it are replaced)')
    p.add_argument('--quant-dtype', default='int8', choices=('int8', 'fp8'),
                   help='weights and activations in int8 or fp8 e4m3 (default: %(default)s)')
    p.add_argument('--calib-dataset', default=None, metavar='PATH',
                   help='calibration text: a local .txt file, or .jsonl with a "text" field a line (default: the '
                   'text of pydoc_data.topics, which ships with Python)')
    p.add_argument('--calib-samples', type=int, default=128, help='calibration windows (default: %(default)s)')
    p.add_argument('--calib-seqlen', type=int, default=2048,
                   help='tokens per calibration window (default: %(default)s)')
    p.add_argument('--batch-size', type=int, default=1,
                   help='calibration windows run together (default: %(default)s)')
    p.add_argument('--smooth-alpha', type=float, default=0.5,
                   help='migration strength alpha in [0, 1] (default: %(default)s, as SmoothQuant / LMDeploy)')
    p.add_argument('--no-smooth', dest='smooth', action='store_false',
                   help='skip the smoothing: plain per-channel / per-token round-to-nearest')
    p.add_argument('--calib-stats', default=None, metavar='DIR',
                   help='a `lmdeploy lite calibrate` work dir: take the activation maxima from its '
                   'inputs_stats.pt instead of running the calibration windows')
    _device_arg(p)
    p.set_defaults(func=run_smooth_quant)


CALIBRATE_DOC = """``lmdeploy lite calibrate MODEL --work-dir OUT``: per-channel statistics of what each decoder
linear reads (absmax, absmean, max, min, mean over the calibration tokens), layer by layer in float, saved as
OUT/inputs_stats.pt with OUT/calibration.json; ``lmdeploy lite smooth_quant --calib-stats OUT`` reuses them.
Llama, Mistral, Qwen2 and Qwen3 models; calibration text as for auto_awq.
"""


def _add_calibrate(cmds):
    p = cmds.add_parser('calibrate', help='record what each decoder linear reads, per channel, into --work-dir',
                        description=CALIBRATE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common_args(p, weights=False)
    _device_arg(p)
    p.set_defaults(func=run_calibrate)


def run_calibrate(args, stdout=None) -> int:
    from lmdeploy.lite import calibrate
    r = calibrate(args.model, args.work_dir, calib_dataset=args.calib_dataset, calib_samples=args.calib_samples,
                  calib_seqlen=args.calib_seqlen, batch_size=args.batch_size, device=args.device)
    print(f'wrote {args.work_dir}/inputs_stats.pt: {r["layers"]} layers, {r["calib_tokens"]} calibration tokens, '
          f'on {r["device"]}, {r["seconds"]:.0f} s', file=stdout or sys.stdout)
    return 0


def run_smooth_quant(args, stdout=None) -> int:
    from lmdeploy.lite import smooth_quant
    r = smooth_quant(args.model, args.work_dir, quant_dtype=args.quant_dtype, calib_dataset=args.calib_dataset,
                     calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen, batch_size=args.batch_size,
                     smooth_alpha=args.smooth_alpha, smooth=args.smooth, device=args.device,
                     calib_stats=args.calib_stats)
    print(f'wrote {args.work_dir}: {r["layers"]} layers, W8A8 {r["quant_dtype"]}, smoothing alpha '
          f'{r["smooth_alpha"]}, {r["calib_tokens"]} calibration tokens, on {r["device"]}, {r["seconds"]:.0f} s',
          file=stdout or sys.stdout)
    return 0
