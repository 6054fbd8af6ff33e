source .s19/common.sh
step bd 120 python3 scripts/kernel_breakdown.py --preset qwen3-30b-a3b --tokens 1,4,16,64,256 --backends triton --top 8 --out $R/bd.md
step bd_pdl 120 python3 scripts/kernel_breakdown.py --preset qwen3-30b-a3b --tokens 1,4,16,64,256 --backends triton --top 8 --pdl --out $R/bd_pdl.md
cat $R/bd_pdl.md | head -120
pack
