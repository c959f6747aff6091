module github.com/neuron-scheduler/tools/tlsdial

go 1.26.0
