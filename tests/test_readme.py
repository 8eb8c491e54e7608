"""The README's Python block runs as written, on a CPU, in well under a minute (the issue's bound)."""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_block_runs_as_written(smollm2_path):
    text = open(os.path.join(ROOT, 'README.md')).read()
    block = re.search(r'## Python API\s+```python\n(.*?)```', text, re.S).group(1)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    start = time.monotonic()
    run = subprocess.run([sys.executable, '-c', block], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count('Response(text=') == 2, run.stdout[-2000:]  # the batch of two
    assert re.search(r'^\[\d+\.\d+\]$', run.stdout, re.M), run.stdout[-2000:]  # get_ppl's list
    print(f'README block: {took:.1f} s')
