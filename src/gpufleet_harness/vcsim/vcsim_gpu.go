// Command vcsim-gpu serves govmomi's vCenter simulator (vcsim) with ESXi hosts that carry NVIDIA GPUs.
//
// Test harness for gpufleet's esxi_gpu_passthrough module; built and started by gpufleet_harness.vcsim.
// Everything below the simulator itself is ours, written for govmomi 0.24 (Debian bookworm):
//
//   - GPUs in each host's hardware.pciDevice (the simulator lists only its own 43 devices);
//   - a HostPciPassthruSystem per host (0.24 has none) with pciPassthruInfo, UpdatePassthruConfig and
//     Refresh; newly enabled passthrough stays inactive until the host is "rebooted" through the
//     harness's own endpoint POST /gpufleet/reboot?host=NAME, unless the host activates at once;
//   - config.pciPassthruInfo on each host, kept equal to the passthrough system's;
//   - the API version is announced as 7.0 (the model says 6.5) so clients use vSphere 7 types;
//   - QueryConfigTarget fills pciPassthrough (active GPUs no other VM holds) and dynamicPassthrough
//     (the 0.24 simulator fills neither);
//   - ReconfigVM_Task refuses what vSphere refuses and the simulator accepts: device, firmware or
//     memory changes on a powered-on VM, and DirectPath backings that name a missing, inactive or
//     taken device or another host's system id; PowerOnVM_Task refuses a VM with passthrough devices
//     whose memory reservation is not locked to its size (the fault messages are our wording);
//   - VMs are created through the API from the scenario (name, host, folder, memory, power state), and
//     VMware Tools can be marked running so that the guest-shutdown path is taken.
//
// Only the scenario's user and password can log in (the simulator's own Listen.User check).
//
// Flags: -listen 127.0.0.1:0, -scenario FILE (JSON: hosts with GPUs, VMs), -username NAME. The password
// comes from $GPUFLEET_VCSIM_PASSWORD. Once ready it prints one JSON line: {"url": ..., "control": ...}.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io/ioutil"
	"log"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"sync"
	"syscall"

	"github.com/vmware/govmomi"
	"github.com/vmware/govmomi/object"
	"github.com/vmware/govmomi/simulator"
	"github.com/vmware/govmomi/vim25/methods"
	"github.com/vmware/govmomi/vim25/mo"
	"github.com/vmware/govmomi/vim25/soap"
	"github.com/vmware/govmomi/vim25/types"
)

const nvidiaVendor = 0x10de

type gpuSpec struct {
	ID       string `json:"id"`
	DeviceID int    `json:"device_id"`
	Name     string `json:"name"`
	Capable  bool   `json:"capable"`
	Enabled  bool   `json:"enabled"`
	Active   bool   `json:"active"`
}

type hostSpec struct {
	Name                  string    `json:"name"`
	ActivateWithoutReboot bool      `json:"activate_without_reboot"`
	GPUs                  []gpuSpec `json:"gpus"`
}

type vmSpec struct {
	Name         string `json:"name"`
	Host         string `json:"host"`
	Folder       string `json:"folder"`
	MemoryMB     int64  `json:"memory_mb"`
	CPUs         int32  `json:"cpus"`
	PoweredOn    bool   `json:"powered_on"`
	ToolsRunning bool   `json:"tools_running"`
}

type scenario struct {
	Hosts []hostSpec `json:"hosts"`
	VMs   []vmSpec   `json:"vms"`
}

// gpuHost is our state for one simulated ESXi host: its GPUs and their passthrough switches.
type gpuHost struct {
	host      *simulator.HostSystem
	spec      hostSpec
	systemID  string
	devices   map[string]types.HostPciDevice
	passthru  map[string]*types.HostPciPassthruInfo
	deviceIDs []string // sorted, for stable listings
}

var (
	hostsMu sync.Mutex
	byRef   = map[types.ManagedObjectReference]*gpuHost{}
	byName  = map[string]*gpuHost{}
)

// signed16 stores a PCI id the way the vSphere API types it (short), e.g. 0x8086 as -31610.
func signed16(v int) int16 {
	return int16(uint16(v))
}

func pciDevice(g gpuSpec) types.HostPciDevice {
	var bus, slot, function int
	if _, err := fmt.Sscanf(g.ID[5:], "%x:%x.%x", &bus, &slot, &function); err != nil {
		log.Fatalf("GPU id %q is not a PCI address like 0000:3b:00.0", g.ID)
	}
	return types.HostPciDevice{
		Id:           g.ID,
		ClassId:      0x0302, // 3D controller, as data-center GPUs report
		Bus:          byte(bus),
		Slot:         byte(slot),
		Function:     byte(function),
		VendorId:     signed16(nvidiaVendor),
		SubVendorId:  signed16(nvidiaVendor),
		VendorName:   "NVIDIA Corporation",
		DeviceId:     signed16(g.DeviceID),
		SubDeviceId:  0,
		ParentBridge: fmt.Sprintf("0000:%02x:00.0", bus-1),
		DeviceName:   g.Name,
	}
}

// passthruSystem is the host's configManager.pciPassthruSystem.
type passthruSystem struct {
	mo.HostPciPassthruSystem
	gh *gpuHost
}

func (p *passthruSystem) UpdatePassthruConfig(req *types.UpdatePassthruConfig) soap.HasFault {
	body := &methods.UpdatePassthruConfigBody{}
	hostsMu.Lock()
	defer hostsMu.Unlock()
	for _, base := range req.Config {
		cfg := base.GetHostPciPassthruConfig()
		info, ok := p.gh.passthru[cfg.Id]
		if !ok {
			body.Fault_ = simulator.Fault(fmt.Sprintf("no PCI device %s on host %s", cfg.Id, p.gh.host.Name),
				&types.NotFound{})
			return body
		}
		if !info.PassthruCapable {
			body.Fault_ = simulator.Fault(fmt.Sprintf("PCI device %s is not capable of passthrough", cfg.Id),
				&types.HostConfigFault{})
			return body
		}
	}
	for _, base := range req.Config {
		cfg := base.GetHostPciPassthruConfig()
		info := p.gh.passthru[cfg.Id]
		info.PassthruEnabled = cfg.PassthruEnabled
		if p.gh.spec.ActivateWithoutReboot || !cfg.PassthruEnabled {
			info.PassthruActive = cfg.PassthruEnabled
		}
	}
	p.gh.publish()
	body.Res = &types.UpdatePassthruConfigResponse{}
	return body
}

func (p *passthruSystem) Refresh(req *types.Refresh) soap.HasFault {
	return &methods.RefreshBody{Res: &types.RefreshResponse{}}
}

// publish copies the passthrough state to both places vSphere shows it. Callers hold hostsMu.
func (gh *gpuHost) publish() {
	infos := make([]types.BaseHostPciPassthruInfo, 0, len(gh.deviceIDs))
	for _, id := range gh.deviceIDs {
		copied := *gh.passthru[id]
		infos = append(infos, &copied)
	}
	system := simulator.Map.Get(*gh.host.ConfigManager.PciPassthruSystem).(*passthruSystem)
	system.PciPassthruInfo = infos
	gh.host.Config.PciPassthruInfo = infos
}

func (gh *gpuHost) reboot() {
	for _, info := range gh.passthru {
		info.PassthruActive = info.PassthruEnabled
	}
	gh.publish()
}

// heldBy returns the VM (other than except) whose DirectPath device uses PCI device id, or "".
func heldBy(host types.ManagedObjectReference, id string, except types.ManagedObjectReference) string {
	for _, entity := range simulator.Map.All("VirtualMachine") {
		vm := virtualMachine(entity)
		if vm == nil || vm.Self == except || vm.Runtime.Host == nil || *vm.Runtime.Host != host {
			continue
		}
		for _, device := range vm.Config.Hardware.Device {
			if backing := directPathBacking(device); backing != nil && backing.Id == id {
				return vm.Name
			}
		}
	}
	return ""
}

func virtualMachine(entity mo.Reference) *simulator.VirtualMachine {
	switch vm := entity.(type) {
	case *gpuVM:
		return &vm.VirtualMachine
	case *simulator.VirtualMachine:
		return vm
	}
	return nil
}

func directPathBacking(device types.BaseVirtualDevice) *types.VirtualPCIPassthroughDeviceBackingInfo {
	pci, ok := device.(*types.VirtualPCIPassthrough)
	if !ok {
		return nil
	}
	backing, _ := pci.Backing.(*types.VirtualPCIPassthroughDeviceBackingInfo)
	return backing
}

// envBrowser adds the passthrough parts of QueryConfigTarget.
// Embedded by value: the simulator's property collector finds the mo type by walking first fields.
type envBrowser struct {
	simulator.EnvironmentBrowser
}

func (b *envBrowser) QueryConfigTarget(ctx *simulator.Context, req *types.QueryConfigTarget) soap.HasFault {
	body := b.EnvironmentBrowser.QueryConfigTarget(ctx, req).(*methods.QueryConfigTargetBody)
	if body.Res == nil || req.Host == nil {
		return body
	}
	hostsMu.Lock()
	defer hostsMu.Unlock()
	gh := byRef[*req.Host]
	if gh == nil {
		return body
	}
	target := body.Res.Returnval
	models := map[int16]bool{}
	for _, id := range gh.deviceIDs {
		info, device := gh.passthru[id], gh.devices[id]
		if !info.PassthruActive {
			continue
		}
		if !models[device.DeviceId] {
			models[device.DeviceId] = true
			target.DynamicPassthrough = append(target.DynamicPassthrough, types.VirtualMachineDynamicPassthroughInfo{
				VirtualMachineTargetInfo: types.VirtualMachineTargetInfo{Name: device.DeviceName},
				VendorName:               device.VendorName,
				DeviceName:               device.DeviceName,
				VendorId:                 int32(device.VendorId),
				DeviceId:                 int32(device.DeviceId),
			})
		}
		// The browser is shared by the host's VMs and the request names none: a device any VM holds
		// is withheld (a VM's own devices are matched by the module before it looks here).
		if heldBy(*req.Host, id, types.ManagedObjectReference{}) != "" {
			continue
		}
		target.PciPassthrough = append(target.PciPassthrough, &types.VirtualMachinePciPassthroughInfo{
			VirtualMachineTargetInfo: types.VirtualMachineTargetInfo{Name: device.DeviceName},
			PciDevice:                device,
			SystemId:                 gh.systemID,
		})
	}
	return body
}

// gpuVM adds vSphere's refusals for passthrough VMs to the simulator's VM.
type gpuVM struct {
	simulator.VirtualMachine
}

func failedTask(vm mo.Reference, name string, fault types.BaseMethodFault, msg string) types.ManagedObjectReference {
	task := simulator.CreateTask(vm, name, func(*simulator.Task) (types.AnyType, types.BaseMethodFault) {
		return nil, fault
	})
	ref := task.Run()
	simulator.Map.Update(task, []types.PropertyChange{
		{Name: "info.error", Val: types.LocalizedMethodFault{Fault: fault, LocalizedMessage: msg}},
	})
	return ref
}

func (v *gpuVM) refusal(spec *types.VirtualMachineConfigSpec) (types.BaseMethodFault, string) {
	on := v.Runtime.PowerState == types.VirtualMachinePowerStatePoweredOn
	if on && (len(spec.DeviceChange) > 0 || spec.Firmware != "" || spec.BootOptions != nil || spec.MemoryMB != 0) {
		return &types.InvalidPowerState{
				RequestedState: types.VirtualMachinePowerStatePoweredOff,
				ExistingState:  v.Runtime.PowerState,
			},
			"The attempted operation cannot be performed in the current state (Powered on)."
	}
	hostsMu.Lock()
	defer hostsMu.Unlock()
	gh := byRef[*v.Runtime.Host]
	for _, change := range spec.DeviceChange {
		dc := change.GetVirtualDeviceConfigSpec()
		backing := directPathBacking(dc.Device)
		if dc.Operation != types.VirtualDeviceConfigSpecOperationAdd || backing == nil {
			continue
		}
		invalid := &types.InvalidDeviceSpec{InvalidVmConfig: types.InvalidVmConfig{Property: "virtualDeviceSpec.device.backing"}}
		if gh == nil || gh.passthru[backing.Id] == nil {
			return invalid, fmt.Sprintf("PCI device %s does not exist on the VM's host", backing.Id)
		}
		if !gh.passthru[backing.Id].PassthruActive {
			return invalid, fmt.Sprintf("PCI device %s is not active for passthrough", backing.Id)
		}
		if backing.SystemId != gh.systemID {
			return invalid, fmt.Sprintf("PCI device %s: system id %q is not the host's", backing.Id, backing.SystemId)
		}
		device := gh.devices[backing.Id]
		if backing.VendorId != device.VendorId || backing.DeviceId != fmt.Sprintf("%x", uint16(device.DeviceId)) {
			return invalid, fmt.Sprintf("PCI device %s: vendor/device id do not match the host's", backing.Id)
		}
		if holder := heldBy(*v.Runtime.Host, backing.Id, v.Self); holder != "" {
			return invalid, fmt.Sprintf("PCI device %s is in use by VM %s", backing.Id, holder)
		}
	}
	return nil, ""
}

func (v *gpuVM) ReconfigVMTask(ctx *simulator.Context, req *types.ReconfigVM_Task) soap.HasFault {
	if fault, msg := v.refusal(&req.Spec); fault != nil {
		return &methods.ReconfigVM_TaskBody{
			Res: &types.ReconfigVM_TaskResponse{Returnval: failedTask(v, "reconfigVm", fault, msg)},
		}
	}
	return v.VirtualMachine.ReconfigVMTask(ctx, req)
}

func (v *gpuVM) PowerOnVMTask(ctx *simulator.Context, req *types.PowerOnVM_Task) soap.HasFault {
	passthrough := false
	for _, device := range v.Config.Hardware.Device {
		if _, ok := device.(*types.VirtualPCIPassthrough); ok {
			passthrough = true
		}
	}
	locked := v.Config.MemoryReservationLockedToMax != nil && *v.Config.MemoryReservationLockedToMax
	if passthrough && !locked {
		msg := "Invalid memory setting: memory reservation (sched.mem.min) should be equal to memsize."
		return &methods.PowerOnVM_TaskBody{
			Res: &types.PowerOnVM_TaskResponse{Returnval: failedTask(v, "powerOn", &types.InvalidState{}, msg)},
		}
	}
	return v.VirtualMachine.PowerOnVMTask(ctx, req)
}

func loadScenario(path string) scenario {
	var s scenario
	data, err := ioutil.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(data, &s)
	}
	if err != nil {
		log.Fatalf("scenario %s: %v", path, err)
	}
	if len(s.Hosts) == 0 {
		log.Fatalf("scenario %s: no hosts", path)
	}
	return s
}

// equipHosts renames the model's standalone hosts and gives them GPUs and a passthrough system.
func equipHosts(s scenario) {
	var hosts []*simulator.HostSystem
	for _, entity := range simulator.Map.All("HostSystem") {
		hosts = append(hosts, entity.(*simulator.HostSystem))
	}
	sort.Slice(hosts, func(i, j int) bool { return hosts[i].Name < hosts[j].Name })
	for i, spec := range s.Hosts {
		h := hosts[i]
		h.Name = spec.Name
		h.Summary.Config.Name = spec.Name
		gh := &gpuHost{
			host:     h,
			spec:     spec,
			systemID: h.Hardware.SystemInfo.Uuid,
			devices:  map[string]types.HostPciDevice{},
			passthru: map[string]*types.HostPciPassthruInfo{},
		}
		devices := append([]types.HostPciDevice{}, h.Hardware.PciDevice...)
		for _, g := range spec.GPUs {
			device := pciDevice(g)
			devices = append(devices, device)
			gh.devices[g.ID] = device
			gh.passthru[g.ID] = &types.HostPciPassthruInfo{
				Id:              g.ID,
				DependentDevice: g.ID,
				PassthruCapable: g.Capable,
				PassthruEnabled: g.Capable && g.Enabled,
				PassthruActive:  g.Capable && g.Enabled && g.Active,
			}
			gh.deviceIDs = append(gh.deviceIDs, g.ID)
		}
		sort.Strings(gh.deviceIDs)
		h.Hardware.PciDevice = devices
		system := &passthruSystem{gh: gh}
		system.Self = types.ManagedObjectReference{Type: "HostPciPassthruSystem", Value: "pcipassthru-" + h.Self.Value}
		simulator.Map.Put(system)
		ref := system.Self
		h.ConfigManager.PciPassthruSystem = &ref
		gh.publish()
		byRef[h.Self] = gh
		byName[spec.Name] = gh
	}
	for _, kind := range []string{"ComputeResource", "ClusterComputeResource"} {
		for _, entity := range simulator.Map.All(kind) {
			var ref *types.ManagedObjectReference
			switch cr := entity.(type) {
			case *mo.ComputeResource:
				ref = cr.EnvironmentBrowser
			case *simulator.ClusterComputeResource:
				ref = cr.EnvironmentBrowser
			}
			if ref == nil {
				continue
			}
			if eb, ok := simulator.Map.Get(*ref).(*simulator.EnvironmentBrowser); ok {
				simulator.Map.Put(&envBrowser{*eb})
			}
		}
	}
}

// createVMs creates the scenario's VMs through the API, then wraps each in gpuVM.
func createVMs(ctx context.Context, c *govmomi.Client, s scenario) error {
	dc := simulator.Map.Any("Datacenter").(*simulator.Datacenter)
	root := object.NewFolder(c.Client, dc.VmFolder)
	folders := map[string]*object.Folder{"": root}
	for _, spec := range s.VMs {
		gh := byName[spec.Host]
		if gh == nil {
			return fmt.Errorf("VM %s: no host %q in the scenario", spec.Name, spec.Host)
		}
		folder := folders[spec.Folder]
		if folder == nil {
			created, err := root.CreateFolder(ctx, spec.Folder)
			if err != nil {
				return err
			}
			folders[spec.Folder], folder = created, created
		}
		parent := simulator.Map.Get(*gh.host.Parent).(*mo.ComputeResource)
		pool := object.NewResourcePool(c.Client, *parent.ResourcePool)
		host := object.NewHostSystem(c.Client, gh.host.Self)
		cpus := spec.CPUs
		if cpus == 0 {
			cpus = 4
		}
		config := types.VirtualMachineConfigSpec{
			Name:     spec.Name,
			GuestId:  string(types.VirtualMachineGuestOsIdentifierUbuntu64Guest),
			NumCPUs:  cpus,
			MemoryMB: spec.MemoryMB,
			Files:    &types.VirtualMachineFileInfo{VmPathName: "[LocalDS_0]"},
		}
		task, err := folder.CreateVM(ctx, config, pool, host)
		if err != nil {
			return err
		}
		info, err := task.WaitForResult(ctx, nil)
		if err != nil {
			return fmt.Errorf("creating VM %s: %v", spec.Name, err)
		}
		ref := info.Result.(types.ManagedObjectReference)
		vm := simulator.Map.Get(ref).(*simulator.VirtualMachine)
		if spec.ToolsRunning {
			vm.Guest.ToolsRunningStatus = string(types.VirtualMachineToolsRunningStatusGuestToolsRunning)
			vm.Guest.ToolsStatus = types.VirtualMachineToolsStatusToolsOk
		}
		simulator.Map.Put(&gpuVM{*vm})
		if spec.PoweredOn {
			task, err := object.NewVirtualMachine(c.Client, ref).PowerOn(ctx)
			if err == nil {
				err = task.Wait(ctx)
			}
			if err != nil {
				return fmt.Errorf("powering on VM %s: %v", spec.Name, err)
			}
		}
	}
	return nil
}

func rebootHandler(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	hostsMu.Lock()
	defer hostsMu.Unlock()
	gh := byName[r.URL.Query().Get("host")]
	if gh == nil {
		http.Error(w, "no such host", http.StatusNotFound)
		return
	}
	gh.reboot()
	fmt.Fprintln(w, "rebooted")
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to serve the vSphere API on")
	scenarioPath := flag.String("scenario", "", "JSON file describing hosts, GPUs and VMs")
	username := flag.String("username", "gpufleet@vsphere.local", "the only user that can log in")
	flag.Parse()
	password := os.Getenv("GPUFLEET_VCSIM_PASSWORD")
	if *scenarioPath == "" || password == "" {
		log.Fatal("usage: vcsim-gpu -scenario FILE [-listen ADDR] [-username NAME], password in $GPUFLEET_VCSIM_PASSWORD")
	}
	s := loadScenario(*scenarioPath)

	model := simulator.VPX()
	// Dynamic DirectPath is a vSphere 7 feature: announce API 7.0 so that clients (pyVmomi) use the
	// 7.0 type system, which the simulator's types (govmomi 0.24) already cover.
	about := &model.ServiceContent.About
	about.ApiVersion, about.Version, about.Build = "7.0.0.0", "7.0.0", "gpufleet-vcsim"
	about.FullName = "VMware vCenter Server 7.0.0 (govmomi vcsim with gpufleet GPU hosts)"
	model.Host = len(s.Hosts)
	model.Cluster = 0
	model.ClusterHost = 0
	model.Machine = 0
	model.Portgroup = 0
	model.Autostart = false
	if err := model.Create(); err != nil {
		log.Fatal(err)
	}
	defer model.Remove()
	equipHosts(s)

	model.Service.Listen = &url.URL{Host: *listen, User: url.UserPassword(*username, password)}
	model.Service.ServeMux = http.NewServeMux()
	model.Service.ServeMux.HandleFunc("/gpufleet/reboot", rebootHandler)
	server := model.Service.NewServer()
	defer server.Close()

	ctx := context.Background()
	client, err := govmomi.NewClient(ctx, server.URL, true)
	if err != nil {
		log.Fatal(err)
	}
	if err := createVMs(ctx, client, s); err != nil {
		log.Fatal(err)
	}
	_ = client.Logout(ctx)

	public := *server.URL
	public.User = nil
	control := url.URL{Scheme: public.Scheme, Host: public.Host, Path: "/gpufleet"}
	ready, _ := json.Marshal(map[string]string{"url": public.String(), "control": control.String()})
	fmt.Println(string(ready))

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	log.Printf("vcsim-gpu stopping on %s", <-stop)
}
