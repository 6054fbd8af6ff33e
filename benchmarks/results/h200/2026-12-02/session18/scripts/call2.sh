source .s18/common.sh
TAB=$PWD/.s18/tab; mkdir -p $TAB .s18/empty; cp src/moekit/tuning/configs/nvidia_h200.json $TAB/; echo '{}' > .s18/empty/nvidia_h200.json
MOEKIT_CONFIG_DIR=$TAB step tune_gptoss 280 moekit tune --preset gpt-oss-20b --tokens 64,128,256 --out $R/tune_gptoss
cp $TAB/nvidia_h200.json $R/tab_gptoss.json
MOEKIT_CONFIG_DIR=$TAB step gptoss_tuned 100 moekit bench --preset gpt-oss-20b --tokens 1,4,16,64,128,256,1024,4096 --backends triton --out $R/gptoss_tuned
MOEKIT_CONFIG_DIR=$PWD/.s18/empty step gptoss_default 60 moekit bench --preset gpt-oss-20b --tokens 64,128,256 --backends triton --no-layer --no-dense --out $R/gptoss_default
pack
