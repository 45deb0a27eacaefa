B=/tmp/lh/.bundle
run=$(mktemp -d /tmp/lh-d.XXXX); export LEASEHOLD_ENDPOINT=ipc://$run/c.sock
$B/bin/leasehold-coordinator --backend cuda --devices 0 --pool-size 30GiB --mps off --state-dir $run/s > $OUT/c.log 2>&1 & c=$!
sleep 2
$B/bin/leasehold-agent --name a --python-dir $PWD/python --torch-plugin $B/lib/libleasehold_torch.so > $OUT/a.log 2>&1 & a=$!
sleep 4
for budget in 6464000000 3232000000; do
$B/bin/leasehold run --budget $budget -- python3 tests/torch/train.py --model gpt2-small --amp --batch 12 --seq 1024 --steps 12 --warmup 4 --log-every 100 > $OUT/run-$budget.log 2>&1
echo "budget $budget rc=$?"; grep -E '"type": "(oom|summary)"' $OUT/run-$budget.log | cut -c1-1500
done
kill $a $c; wait
